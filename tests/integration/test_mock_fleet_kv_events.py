"""``mock_fleet`` (as ``kappa-gateway mock-fleet`` runs it) starts a backend's KV-event publisher when its
entry has ``kv_events``: a child-process mock on free loopback ports, a ZMQ SUB and DEALER connecting to
the entry's endpoints, as the gateway will. The encoding flag reaches the worker.
"""

from __future__ import annotations

import time

import httpx
import msgpack
import pytest
import zmq

from fleet_config.catalog import default_catalog
from fleet_config.settings import parse_settings
from gateway.commands.fleet import mock_fleet
from gateway.commands.processes import free_port

pytestmark = pytest.mark.integration

MODEL = "llama-3.1-8b"
TOPIC = "kv@a@llama-3.1-8b"
DEADLINE_S = 20.0
PROBE_WAIT_MS = 100


def test_a_fleet_backend_with_kv_events_publishes_on_its_entrys_endpoints() -> None:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    backend = {"id": "a", "url": f"http://127.0.0.1:{free_port()}", "model": MODEL, "hardware": "h100-sxm",
               "kv_events": {"endpoint": pub, "replay_endpoint": replay, "topic": TOPIC}}
    settings = parse_settings({"gateway": {"port": free_port()}, "backends": [backend]}, default_catalog(), env={})
    ctx = zmq.Context()
    sub, dealer = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
    for sock in (sub, dealer):
        sock.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    try:
        with mock_fleet(settings, time_scale=0.01, worker_flags=["--kv-events-encoding", "positional"]), \
                httpx.Client(base_url=backend["url"], timeout=30) as http:
            sub.connect(pub)
            deadline = time.monotonic() + DEADLINE_S
            while not sub.poll(PROBE_WAIT_MS):  # reset until a batch arrives (a PUB drops before subscription)
                assert http.post("/reset_prefix_cache").status_code == 200
                assert time.monotonic() < deadline, "no KV-event batch from the fleet's mock"
            topic, seq, payload = sub.recv_multipart()
            assert topic == TOPIC.encode() and msgpack.unpackb(payload)[1] == [["AllBlocksCleared"]]
            dealer.connect(replay)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            assert dealer.poll(DEADLINE_S * 1000)
            assert dealer.recv_multipart()[:3] == [b"", TOPIC.encode(), (0).to_bytes(8, "big")]  # the first probe
    finally:
        sub.close()
        dealer.close()
        ctx.term()
