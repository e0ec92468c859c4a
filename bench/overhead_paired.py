"""Gateways from several source trees, CPU per request round by round: a paired comparison.

`bench/overhead.py` keeps each target's median CPU per request over its rounds. On a shared
machine a busy phase inflates every target's CPU for a while (the same code read 0.6 and
1.1 ms/request an hour apart), so this script loads only Redis gateways (this tree's, as
``redis``, and each ``--compare NAME=DIR`` tree's, as ``redis@NAME``) with 8k-token chat bodies at
concurrency 32, one short cell each per round, in rotated order, and keeps every round's figure:
each target's median, and the median over rounds of its CPU ÷ the reference's (the last
``--compare``) in that same round. The servers, bodies and load are `bench/overhead.py`'s
(`overhead_servers.servers`, `overhead.make_bodies`, `overhead.run_load`), all on 127.0.0.1.

    python bench/overhead_paired.py --compare base=DIR [--compare ...] [--rounds 12] [--cell-s 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import hot_path

hot_path.select()  # an entry point: compiled or source, before the project is imported

from overhead import cpu_s, make_bodies, run_load  # noqa: E402
from overhead_servers import servers  # noqa: E402

CONCURRENCY, SIZE, WARMUP_S = 32, "8k", 1.0


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, list[float]]:
    """target -> its CPU ms per request, one figure per round (rounds in rotated target order)."""
    server_args = argparse.Namespace(targets=["redis"], compare=args.compare, peer_pythons={}, peer_commands={})
    with servers(server_args, workdir) as (targets, _):
        bodies = workdir / "bodies.txt"
        bodies.write_bytes(b"\n".join(make_bodies(SIZE, False)))
        names = [t for t in targets if t.startswith("redis")]
        for t in names:
            run_load(targets[t][0], bodies, CONCURRENCY, WARMUP_S)
        cpu: dict[str, list[float]] = {t: [] for t in names}
        for r in range(args.rounds):
            for t in names[r % len(names):] + names[: r % len(names)]:
                port, pid = targets[t]
                before = cpu_s(pid)
                run = run_load(port, bodies, CONCURRENCY, args.cell_s)
                cpu[t].append((cpu_s(pid) - before) * 1e3 / (run["completed"] + run["warmup"]))
            print(f"round {r}: " + ", ".join(f"{t} {v[-1]:.3f}" for t, v in cpu.items()), file=sys.stderr, flush=True)
    return cpu


def summarise(cpu: dict[str, list[float]], reference: str) -> dict[str, dict[str, float]]:
    """Per target: the median and min CPU ms/request, and the median of its per-round ratio to ``reference``."""
    return {t: {"cpu_ms_per_request_median": statistics.median(v), "cpu_ms_per_request_min": min(v),
                f"paired_ratio_vs_{reference}": statistics.median(a / b for a, b in zip(v, cpu[reference]))}
            for t, v in cpu.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compare", action="append", required=True, metavar="NAME=DIR",
                   help="also load a Redis gateway run from source tree DIR, as target redis@NAME (the last: the reference)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--cell-s", type=float, default=2.0, help="seconds per cell")
    p.add_argument("--json", action="store_true", help="print the rounds and the summary as JSON on stdout")
    args = p.parse_args(argv)
    args.compare = [tuple(c.split("=", 1)) for c in args.compare]
    with tempfile.TemporaryDirectory(prefix="kappa-paired-") as tmp:
        cpu = measure(args, Path(tmp))
    reference = f"redis@{args.compare[-1][0]}"
    summary = summarise(cpu, reference)
    for t, s in summary.items():
        print(f"{t:24s} median {s['cpu_ms_per_request_median']:.3f} ms/req, min {s['cpu_ms_per_request_min']:.3f}, "
              f"paired ratio vs {reference} {s[f'paired_ratio_vs_{reference}']:.3f}", file=sys.stderr)
    if args.json:
        print(json.dumps({"command": " ".join(sys.orig_argv), "size": SIZE, "concurrency": CONCURRENCY,
                          "cell_s": args.cell_s, "rounds": cpu, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
