"""Memory per request body: the gateway process's peak RSS growth for large bodies.

Starts `bench/upstream_stub.py` (answers at once) and ``kappa-gateway serve`` in front of it,
both on 127.0.0.1; sends one body of ``--body-mib`` MiB, then ``--concurrent`` at once, and
reads the gateway's peak RSS (``VmHWM`` in ``/proc/<pid>/status``) before and after each.
Prints, as JSON, the growth per body in multiples of the body size (the issue's budget: ≤ 2×
for the gateway's own copies; what a parsed body costs is in BENCHMARKS.md, "Memory per
request body").

    python bench/body_memory.py --body-mib 31 --concurrent 4 --kind text --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import hot_path  # noqa: E402

hot_path.select()  # this script is an entry point: compiled or source, before the project is imported

from gateway.commands.processes import answers_ok, free_port, stop_processes  # noqa: E402

MODEL = "llama-3.1-8b"


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc (Linux only)")


def make_body(size_bytes: int, kind: str = "text") -> bytes:
    """A chat body of about ``size_bytes``: ``text`` (a system prompt of words and a user turn
    of text: all of it canonical prompt text) or ``image`` (one base64 image part, the usual
    reason a body is tens of MiB: the index hashes it to one digest)."""
    if kind == "image":
        part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * size_bytes}}
        return json.dumps({"model": MODEL, "max_tokens": 1,
                           "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
                           }).encode()
    words = "context " * (size_bytes // 16)
    return json.dumps({"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "system", "content": words}, {"role": "user", "content": "q" * (size_bytes // 2)}]}).encode()


async def send(url: str, body: bytes, n: int) -> list[int]:
    async with aiohttp.ClientSession() as http:
        async def one() -> int:
            async with http.post(url, data=body, headers={"content-type": "application/json"}) as resp:
                await resp.read()
                return resp.status
        return await asyncio.gather(*(one() for _ in range(n)))


def wait_until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)  # poll interval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--body-mib", type=float, default=31.0)
    parser.add_argument("--concurrent", type=int, default=4)
    parser.add_argument("--kind", choices=("text", "image"), default="text", help="what fills the body")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    procs: list[subprocess.Popen] = []
    try:
        stub = subprocess.Popen([sys.executable, str(REPO / "bench" / "upstream_stub.py"), "--listeners", "1"],
                                stdout=subprocess.PIPE, text=True, cwd=REPO)
        procs.append(stub)
        (stub_port,) = json.loads(stub.stdout.readline())["ports"]
        port = free_port()
        config = {"gateway": {"port": port, "max_body_bytes": 64 * 1024 * 1024, "access_log": False},
                  "backends": [{"id": "b0", "url": f"http://127.0.0.1:{stub_port}", "model": MODEL,
                                "hardware": "h100-sxm"}]}
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            json.dump(config, f)
        gw = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", f.name, "--log-level", "warning"],
                              cwd=REPO)
        procs.append(gw)
        wait_until(lambda: answers_ok(f"http://127.0.0.1:{port}/ready"), "the gateway to be ready")
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = make_body(int(args.body_mib * 1024 * 1024), args.kind)
        asyncio.run(send(url, make_body(64 * 1024), 4))  # warm up: imports, pools, first allocations
        before = peak_rss_bytes(gw.pid)
        statuses = asyncio.run(send(url, body, 1))
        after_one = peak_rss_bytes(gw.pid)
        statuses += asyncio.run(send(url, body, args.concurrent))
        after_many = peak_rss_bytes(gw.pid)
        out = {
            "kind": args.kind, "body_bytes": len(body), "statuses": sorted(set(statuses)),
            "peak_rss_growth_one_body_bytes": after_one - before,
            "peak_rss_growth_one_body_ratio": round((after_one - before) / len(body), 2),
            "concurrent": args.concurrent,
            "peak_rss_growth_concurrent_bytes": after_many - before,
            "peak_rss_growth_per_concurrent_body_ratio": round((after_many - before) / len(body) / args.concurrent, 2),
        }
    finally:
        stop_processes(procs)
    print(json.dumps(out, indent=2) if args.json else
          f"one {len(body) / 2**20:.1f} MiB body: peak RSS +{out['peak_rss_growth_one_body_ratio']}x; "
          f"{args.concurrent} at once: +{out['peak_rss_growth_per_concurrent_body_ratio']}x each")


if __name__ == "__main__":
    main()
