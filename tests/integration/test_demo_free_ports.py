"""The demo (and every bench that starts the demo fleet) moves the KV-event endpoints to free ports
with the backends' URLs (`gateway.commands.demo.on_free_ports`): ``config/fleet.local.yaml`` names
fixed ports 5557–5564, which the mocks bind, so a demo beside another fleet (a second demo, a bench, a
user's vLLM publishing on vLLM's default 5557) would otherwise fail to start.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from urllib.parse import urlsplit

import pytest

from fleet_config.catalog import default_catalog
from fleet_config.settings import load_settings
from gateway.commands.demo import DEFAULT_CONFIG, on_free_ports
from gateway.commands.fleet import mock_fleet

pytestmark = pytest.mark.integration

CONFIG_EVENT_PORTS = set(range(5557, 5565))  # the shipped config's endpoints and replay endpoints


def _port(address: str) -> int:
    port = urlsplit(address).port
    assert port is not None
    return port


def test_every_event_endpoint_moves_to_its_own_free_port() -> None:
    shipped = load_settings(DEFAULT_CONFIG, default_catalog(), env={})
    assert {_port(a) for b in shipped.backends for a in (b.kv_events.endpoint, b.kv_events.replay_endpoint)} \
        == CONFIG_EVENT_PORTS
    moved = on_free_ports(shipped)
    ports = [_port(a) for b in moved.backends for a in (b.kv_events.endpoint, b.kv_events.replay_endpoint)]
    ports += [_port(b.url) for b in moved.backends] + [moved.gateway.port]
    assert len(ports) == 13 and len(set(ports)) == 13  # 4 × (events, replay, HTTP) + the gateway
    assert not CONFIG_EVENT_PORTS & set(ports)
    assert all(urlsplit(b.kv_events.endpoint).hostname == "127.0.0.1" for b in moved.backends)
    assert [b.kv_events.topic for b in moved.backends] == [b.kv_events.topic for b in shipped.backends]


@contextmanager
def _held(ports: set[int]) -> Iterator[None]:
    """Listen on each port we can take; a port another process holds is taken anyway."""
    with ExitStack() as stack:
        for port in sorted(ports):
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", port))
                sock.listen()
            except OSError:
                pass  # already in use: as taken as if we held it
        yield


def test_the_demo_fleet_starts_while_the_configs_event_ports_are_taken() -> None:
    settings = on_free_ports(load_settings(DEFAULT_CONFIG, default_catalog(), env={}))
    with _held(CONFIG_EVENT_PORTS), mock_fleet(settings, time_scale=0.01) as mocks:
        assert [m.proc.poll() for m in mocks] == [None]  # one process (the shared KV pool), running and healthy
