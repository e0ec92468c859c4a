"""What a peer router's P/D mode sends a P/D mock fleet, captured on the wire (issue 26, "Peers, live").

Starts the mocks of a P/D config (default ``config/fleet.pd.local.yaml``, moved to free ports) in
one child process, each mock wrapped in a recording ASGI middleware (bench-only: the product's
mocks are unchanged) that appends every request it receives — method, path, the headers a
router adds, the JSON body — and its answer (status; a non-streamed JSON body, or a streamed
answer's first and last events) to ``<dir>/<backend id>.jsonl``. Then starts the peer in its P/D
mode in front of them (prefill-role mocks as prefill workers, decode-role ones as decode
workers, a ``both`` mock as ``--both-as``), sends a few chat and completion requests (streamed
with usage, and not), and writes what the client got and what reached each mock.

Usage::

    python bench/pd_capture.py --peer vllm-router-pd --out bench/results/pd_capture_vllm_router.json
    python bench/pd_capture.py --peer sglang-router-pd --out bench/results/pd_capture_sglang_router.json
    python bench/pd_capture.py --peer kappa        # the gateway itself, for comparison
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import hot_path  # noqa: E402

hot_path.select()

import yaml  # noqa: E402

from fleet_config.catalog import default_catalog  # noqa: E402
from fleet_config.settings import Settings, load_settings  # noqa: E402
from gateway.commands.demo import gateway_process, on_free_ports  # noqa: E402
from gateway.commands.fleet import READY_TIMEOUT_S, POLL_INTERVAL_S  # noqa: E402
from gateway.commands.processes import stop_processes  # noqa: E402
from peer_routers import PD_PEER_ROUTERS, install_peers, venvs_root  # noqa: E402
from routing_live import PD_CONFIG, pd_peer_process, pd_roles  # noqa: E402

BODY_LIMIT = 4000  # characters of a body kept in the capture (prompts are cut, the fields kept whole)
SKIP_PATHS = ("/metrics",)  # scraped often; nothing of the protocol in them


# --------------------------------------------------------------------------------------------- mocks side

class Recorder:
    """ASGI middleware: one JSON line per HTTP request to ``log`` (see the module docstring)."""

    def __init__(self, app: Any, log: Path) -> None:
        self.app, self.log = app, log

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in SKIP_PATHS:
            await self.app(scope, receive, send)
            return
        request = bytearray()
        status: list[int] = []
        chunks: list[bytes] = []

        async def recv() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                request.extend(message.get("body", b""))
            return message

        async def snd(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message["type"] == "http.response.body" and message.get("body"):
                chunks.append(message["body"])
            await send(message)

        started = time.time()
        try:
            await self.app(scope, recv, snd)
        finally:
            headers = {k.decode(): v.decode() for k, v in scope.get("headers", [])
                       if k.lower() in (b"x-request-id", b"x-data-parallel-rank", b"content-type", b"user-agent")}
            record = {"t": started, "method": scope["method"], "path": scope["path"],
                      "query": scope.get("query_string", b"").decode(), "headers": headers,
                      "body": _short(_json_or_text(bytes(request))), "status": status[0] if status else None,
                      "response": _short(_response(b"".join(chunks)))}
            with self.log.open("a") as f:
                f.write(json.dumps(record) + "\n")


def _json_or_text(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:BODY_LIMIT]


def _response(raw: bytes) -> Any:
    """A JSON answer parsed; an SSE answer as its first two and last three events."""
    text = raw.decode(errors="replace")
    if text.startswith("data:") or "\ndata:" in text[:200]:
        events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
        keep = events[:2] + ["..."] + events[-3:] if len(events) > 5 else events
        return {"sse_events": len(events), "events": [_json_or_text(e.encode()) for e in keep]}
    return _json_or_text(raw)


def _short(value: Any) -> Any:
    """Long strings (prompts, generated text) and long lists (token ids, block ids) cut."""
    if isinstance(value, str):
        return value if len(value) <= 200 else value[:120] + f"...<{len(value)} chars>"
    if isinstance(value, list):
        return [_short(v) for v in value] if len(value) <= 12 else [_short(v) for v in value[:6]] + [f"...<{len(value)} items>"]
    if isinstance(value, dict):
        return {k: _short(v) for k, v in value.items()}
    return value


def serve_mocks(config: Path, log_dir: Path, time_scale: float) -> int:
    """The child process: every local backend of ``config``, each wrapped in a `Recorder`."""
    from gateway.commands.fleet_worker import build_apps, serve_all, _loop_factory

    settings = load_settings(config, default_catalog(), env={})
    apps = build_apps(settings, default_catalog(), settings.backends, time_scale=time_scale)
    wrapped = [Recorder(app, log_dir / f"{b.id}.jsonl") for app, b in zip(apps, settings.backends, strict=True)]
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(serve_all(wrapped, [b.url for b in settings.backends]))


@contextmanager
def recorded_mocks(settings: Settings, log_dir: Path, time_scale: float) -> Iterator[None]:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="pd-capture-", delete=False) as f:
        yaml.safe_dump(settings.model_dump(mode="json"), f)
    proc = subprocess.Popen([sys.executable, __file__, "--serve-mocks", f.name, "--log-dir", str(log_dir),
                             "--time-scale", str(time_scale)])
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for b in settings.backends:
            while not _get_ok(b.url + "/health"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"recorded mocks did not start (exit {proc.poll()})")
                time.sleep(POLL_INTERVAL_S)
        yield
    finally:
        stop_processes([proc])
        Path(f.name).unlink(missing_ok=True)


def _get_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200
    except OSError:
        return False


# ------------------------------------------------------------------------------------------- router side

REQUESTS = [
    ("chat, not streamed", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Tell me about prefill and decode. " * 40}], "max_tokens": 8}),
    ("chat, streamed with usage", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Tell me about prefill and decode. " * 40}], "max_tokens": 8,
      "stream": True, "stream_options": {"include_usage": True}}),
    ("completion, not streamed", "/v1/completions",
     {"prompt": "A long shared prefix about KV caches. " * 60, "max_tokens": 8}),
]


def client_requests(url: str, model: str) -> list[dict[str, Any]]:
    out = []
    for name, path, body in REQUESTS:
        req = urllib.request.Request(url + path, data=json.dumps({"model": model, **body}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        started = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                status, raw, headers = resp.status, resp.read(), dict(resp.headers)
        except urllib.error.HTTPError as exc:
            status, raw, headers = exc.code, exc.read(), dict(exc.headers)
        except OSError as exc:
            status, raw, headers = None, str(exc).encode(), {}
        out.append({"request": name, "path": path, "status": status, "seconds": round(time.monotonic() - started, 3),
                    "headers": {k: v for k, v in headers.items() if k.lower().startswith("x-")},
                    "response": _short(_response(raw))})
        time.sleep(0.5)  # one at a time: the capture reads in order
    return out


def capture(peer: str, config: Path, *, both_as: str, time_scale: float, log_level: str) -> dict[str, Any]:
    settings = on_free_ports(load_settings(config, default_catalog(), env={}))
    ids = {b.url: b.id for b in settings.backends}
    with tempfile.TemporaryDirectory(prefix="pd-capture-") as tmp:
        log_dir = Path(tmp)
        prefill, decode = pd_roles(settings, both_as)
        with recorded_mocks(settings, log_dir, time_scale):
            if peer == "kappa":
                router = gateway_process(settings)
                command = "kappa-gateway serve --config <the P/D config on free ports>"
            else:
                pythons, skipped = install_peers([peer], venvs_root())
                if skipped:
                    raise SystemExit(f"{peer} unavailable: {skipped}")
                spec = replace(PD_PEER_ROUTERS[peer], log_level=log_level)
                router = pd_peer_process(spec, pythons[peer], prefill, decode, log_path=log_dir / "router.log")
                command = " ".join(spec.command(Path("python"), [ids[u] for u in prefill],
                                                [ids[u] for u in decode], 0, 0))
            with router as url:
                time.sleep(1.0)
                for b in settings.backends:  # what happened before the first request: probes only
                    (log_dir / f"{b.id}.jsonl").touch()
                    (log_dir / f"{b.id}.jsonl").rename(log_dir / f"{b.id}.startup.jsonl")
                client = client_requests(url, settings.served_models()[0])
                time.sleep(1.0)
        per_mock = {}
        for b in settings.backends:
            lines = (log_dir / f"{b.id}.jsonl").read_text().splitlines() if (log_dir / f"{b.id}.jsonl").exists() else []
            startup = (log_dir / f"{b.id}.startup.jsonl").read_text().splitlines()
            probes = sorted({f"{json.loads(x)['method']} {json.loads(x)['path']}" for x in startup})
            records = [json.loads(x) for x in lines]
            per_mock[b.id] = {"kv_role": b.kv_role, "startup_probes": probes,
                              "requests": [r for r in records if r["path"] not in ("/health", "/readiness")],
                              "health_probes": sum(r["path"] == "/health" for r in records)}
        router_log = (log_dir / "router.log").read_text()[-6000:] if (log_dir / "router.log").exists() else ""
    return {"peer": peer, "router_command": command, "both_as": both_as, "client": client, "mocks": per_mock,
            "router_log_tail": router_log}


def summary(doc: dict[str, Any]) -> str:
    lines = [f"== {doc['peer']}: {doc['router_command']}"]
    for c in doc["client"]:
        resp = c["response"]
        usage = (resp.get("usage") if isinstance(resp, dict) else None) or \
            (resp.get("events", [{}])[-2] if isinstance(resp, dict) and "events" in resp and len(resp["events"]) > 1 else None)
        lines.append(f"client {c['request']}: HTTP {c['status']} in {c['seconds']} s; usage/last {json.dumps(usage)[:300]}")
    for mock, m in doc["mocks"].items():
        lines.append(f"-- mock {mock} ({m['kv_role']}): startup probes {m['startup_probes']}")
        for r in m["requests"]:
            body = r["body"] if isinstance(r["body"], dict) else {}
            fields = {k: body.get(k) for k in ("max_tokens", "stream", "kv_transfer_params", "bootstrap_host",
                                               "bootstrap_port", "bootstrap_room") if k in body}
            resp = r["response"] if isinstance(r["response"], dict) else {}
            lines.append(f"   {r['method']} {r['path']} -> {r['status']}  sent {json.dumps(fields)}  "
                         f"x-request-id {r['headers'].get('x-request-id')}  "
                         f"answered kv_transfer_params {json.dumps(resp.get('kv_transfer_params'))}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", choices=(*PD_PEER_ROUTERS, "kappa"), default="vllm-router-pd")
    parser.add_argument("--config", type=Path, default=PD_CONFIG)
    parser.add_argument("--both-as", choices=("prefill", "decode", "both", "none"), default="decode",
                        help="how a kv_role: both mock is listed to the peer")
    parser.add_argument("--time-scale", type=float, default=0.05)
    parser.add_argument("--log-level", default="info", help="the peer's log level, in its spelling (its log tail is kept)")
    parser.add_argument("--out", type=Path, default=None, help="write the whole capture here (JSON)")
    parser.add_argument("--serve-mocks", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--log-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_mocks:
        return serve_mocks(args.serve_mocks, args.log_dir, args.time_scale)
    doc = capture(args.peer, args.config, both_as=args.both_as, time_scale=args.time_scale, log_level=args.log_level)
    print(summary(doc))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
