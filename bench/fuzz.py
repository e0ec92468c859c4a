"""Fuzzed request bodies against a real gateway: no 5xx of its own, no non-OpenAI error, no reset (issue 16).

    python bench/fuzz.py [--bodies N] [--seed S] [--json] [--out FILE] [--tree DIR] [--logdir DIR]

Starts, as its own children on 127.0.0.1 (`faults_fleet.Fleet`: ended by pid when it ends,
also on Ctrl-C), a ``redis-server``, two mock vLLM backends (``python -m gateway
mock-vllm``, llama-3.1-8b on h100-sxm, ``--time-scale 0.001``, each its own process) and the
gateway (``python -m gateway serve``, Redis index). Then hypothesis draws N (route, body)
pairs, seeded (``--seed``), from `tests.support.fuzz_bodies` — mutated OpenAI bodies, deep
nesting around the 1,000/1,024 limits, random JSON, random bytes; the three POST routes
alike — and sends each over that route's ONE keep-alive connection
(`tests.support.keepalive.OneConnection`, never silently reopened). Each answer is sorted:

- ``gateway_5xx``: a 5xx without ``x-kappa-backend``, i.e. the gateway's own (a backend's
  5xx before the first byte also ends as the gateway's 502, so the mocks are held to it too);
- ``non_openai_error_bodies``: a 4xx/5xx whose body is not ``{"error": {"message": str,
  "type": str, "code": <status>}}``, relayed or not;
- ``resets``: the connection was reset or closed by the server (it is then reopened).

At the end each connection must still serve a valid request (``final_ok``). The JSON
(``--json`` on stdout, ``--out FILE``) is ``{"sent", "status_counts", "gateway_5xx",
"non_openai_error_bodies", "resets", ...}`` with, besides, per route counts, ``relayed``,
``relayed_5xx``, ``load_only_requests`` (growth of ``gateway_load_only_requests_total``), up to
five ``problems`` (status and the first 200 bytes of body and answer), ``duration_s`` and the
command. Without ``--json`` a summary goes to stdout. ``--tree DIR`` runs ``python -m gateway``
from another source tree (e.g. ``git archive <commit> | tar -x -C DIR``) to measure another
version of the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from faults_fleet import Fleet

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the shared body strategies and connection (tests/support imports none of ours)

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

from tests.support.fuzz_bodies import MODEL, ROUTES, routed_bodies  # noqa: E402
from tests.support.keepalive import Answer, ConnectionLost, OneConnection, is_openai_error  # noqa: E402

N_BACKENDS, HARDWARE, TIME_SCALE = 2, "h100-sxm", 0.001
VALID = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "still here?"}], "max_tokens": 2},
    "/v1/completions": {"model": MODEL, "prompt": "still here?", "max_tokens": 2},
    "/v1/kappa/route": {"model": MODEL, "messages": [{"role": "user", "content": "still here?"}]},
}
MAX_PROBLEMS = 5


def gateway_config(port: int, backend_ports: list[int], redis_url: str, stub_port: int | None = None) -> dict:
    """The gateway's config; ``stub_port`` (`faults_fleet.Fleet`'s probe stub) is not used here."""
    return {"gateway": {"host": "127.0.0.1", "port": port, "health_interval_s": 0.5, "scrape_interval_s": 1.0,
                        "shutdown_drain_delay_s": 0, "graceful_shutdown_timeout_s": 2},
            "index": {"backend": "redis", "redis_url": redis_url, "key_prefix": "fuzz"},
            "backends": [{"id": f"b{i}", "url": f"http://127.0.0.1:{p}", "model": MODEL, "hardware": HARDWARE}
                         for i, p in enumerate(backend_ports)]}


class Tally:
    """What the answers were, overall and per route."""

    def __init__(self) -> None:
        self.status: Counter[str] = Counter()
        self.by_route: dict[str, Counter[str]] = {r: Counter() for r in ROUTES}
        self.gateway_5xx = self.non_openai = self.resets = self.relayed = self.relayed_5xx = 0
        self.problems: list[dict] = []

    def add(self, route: str, body: bytes, answer: Answer | None, lost: str | None = None) -> None:
        key = "reset" if answer is None else str(answer.status)
        self.status[key] += 1
        self.by_route[route][key] += 1
        wrong = None
        if answer is None:
            self.resets += 1
            wrong = f"connection lost: {lost}"
        else:
            self.relayed += answer.relayed
            if answer.status >= 500:
                if answer.relayed:
                    self.relayed_5xx += 1
                else:
                    self.gateway_5xx += 1
                    wrong = "gateway 5xx"
            if answer.status >= 400 and not is_openai_error(answer):
                self.non_openai += 1
                wrong = wrong or "non-OpenAI error body"
        if wrong and len(self.problems) < MAX_PROBLEMS:
            self.problems.append({"route": route, "what": wrong, "status": None if answer is None else answer.status,
                                  "body": body[:200].decode("utf-8", "replace"),
                                  "answer": None if answer is None else answer.body[:200].decode("utf-8", "replace")})


def fuzz(url: str, bodies: int, seed_value: int, tally: Tally) -> dict[str, bool]:
    """Send ``bodies`` fuzzed bodies, one keep-alive connection per route; then a valid request on each."""
    conns = {route: OneConnection(url) for route in ROUTES}

    @seed(seed_value)
    @settings(max_examples=bodies, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(routed_bodies())
    def send(routed: tuple[str, bytes]) -> None:
        route, body = routed
        try:
            tally.add(route, body, conns[route].post(route, body))
        except ConnectionLost as lost:
            tally.add(route, body, None, str(lost))
            conns[route].reopen()

    try:
        send()
        final = {}
        for route, conn in conns.items():
            try:
                final[route] = conn.post(route, json.dumps(VALID[route]).encode()).status == 200
            except ConnectionLost:
                final[route] = False
        return final
    finally:
        for conn in conns.values():
            conn.close()


def load_only_total(url: str) -> float | None:
    """``gateway_load_only_requests_total`` summed (None: the gateway does not have it)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    values = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("gateway_load_only_requests_total")]
    return sum(values) if values else None


async def _start(fleet: Fleet) -> None:
    try:
        await fleet.start()
    finally:
        if fleet.http is not None:
            await fleet.http.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bodies", type=int, default=10_000, help="bodies to send, over the three routes")
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed (the same seed draws the same bodies)")
    p.add_argument("--json", action="store_true", help="print the JSON on stdout instead of a summary")
    p.add_argument("--out", type=Path, help="also write the JSON to this file")
    p.add_argument("--tree", type=Path, default=ROOT, help="source tree whose `python -m gateway` runs the mocks "
                   "and the gateway (default: this one)")
    p.add_argument("--logdir", type=Path, help="keep the children's logs here (default: a temporary directory)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    began = time.monotonic()
    tally = Tally()
    with contextlib.ExitStack() as stack:
        workdir = args.logdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kappa-fuzz-")))
        workdir.mkdir(parents=True, exist_ok=True)
        fleet = Fleet(workdir, args.tree, gateway_config, n_backends=N_BACKENDS, mock_args=[
            "--model", MODEL, "--hardware", HARDWARE, "--time-scale", str(TIME_SCALE), "--log-level", "warning"])
        stack.callback(fleet.children.end_all)  # also on Ctrl-C: end each child by pid
        asyncio.run(_start(fleet))
        print(f"fleet up: gateway {fleet.url}, logs in {workdir}", file=sys.stderr, flush=True)
        load_only_before = load_only_total(fleet.url)
        final_ok = fuzz(fleet.url, args.bodies, args.seed, tally)
        load_only_after = load_only_total(fleet.url)
        gateway_alive = fleet.children.procs["gateway"].poll() is None
    report = {
        "sent": sum(tally.status.values()), "status_counts": dict(sorted(tally.status.items())),
        "gateway_5xx": tally.gateway_5xx, "non_openai_error_bodies": tally.non_openai, "resets": tally.resets,
        "final_ok": final_ok, "gateway_alive": gateway_alive,
        "relayed": tally.relayed, "relayed_5xx": tally.relayed_5xx,
        "load_only_requests": None if load_only_after is None else load_only_after - (load_only_before or 0.0),
        "by_route": {r: dict(sorted(c.items())) for r, c in tally.by_route.items()}, "problems": tally.problems,
        "config": {"seed": args.seed, "tree": str(args.tree), "backends": N_BACKENDS, "mock_time_scale": TIME_SCALE,
                   "index": "redis"},
        "duration_s": round(time.monotonic() - began, 1), "command": shlex.join(sys.orig_argv),
    }
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        print(text)
    else:
        print(f"sent {report['sent']} in {report['duration_s']} s: gateway 5xx {tally.gateway_5xx}, non-OpenAI error "
              f"bodies {tally.non_openai}, resets {tally.resets}; statuses {report['status_counts']}; final {final_ok}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the children were ended in main's finally
        sys.exit(130)
