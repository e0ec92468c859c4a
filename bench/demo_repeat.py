"""How far two demo runs with one seed differ (issue 27, item 1): the measurement behind
`gateway.commands.demo_compare.REPEAT_TOLERANCES`.

For each size in ``--sizes`` and each policy in ``--policies``, the demo's run
(`gateway.commands.demo.run_policy`: a fresh mock fleet and gateway, the built-in generator with
one seed, replayed through real HTTP) is repeated ``--repetitions`` times, one after the other;
every pair of repetitions is compared by `gateway.commands.demo_compare.repeat_spread` (the
largest per-backend difference in requests and in share, TTFT p90 and E2E p90 relative). Prints,
per size and policy, each run's split and the largest spread over the pairs; ``--json`` writes
them all.

    python bench/demo_repeat.py --sizes 60,400 --repetitions 3 --json bench/results/demo_repeat.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

import hot_path  # noqa: E402

hot_path.select()  # an entry point: compiled or source, before the project is imported

from fleet_config.catalog import default_catalog  # noqa: E402
from fleet_config.settings import load_settings  # noqa: E402
from gateway.commands.demo import (  # noqa: E402
    DEFAULT_CONFIG,
    DEFAULT_RATE_RPS,
    DEFAULT_TIME_SCALE,
    on_free_ports,
    run_policy,
    workload,
)
from gateway.commands.demo_compare import REPEAT_TOLERANCES, repeat_spread, within_tolerance  # noqa: E402

SPREADS = ("backend_requests", "backend_share", "ttft_p90_relative", "e2e_p90_relative")


def measure(size: int, policy: str, repetitions: int, seed: int) -> dict[str, Any]:
    """``repetitions`` runs of ``policy`` on ``size`` requests of one seed; their figures, every
    pair's `repeat_spread`, the largest of each spread and the pairs outside the tolerance for ``size``
    (`gateway.commands.demo_compare.repeat_tolerance`)."""
    settings = load_settings(DEFAULT_CONFIG, default_catalog(), env={})
    reqs = workload(size, None, DEFAULT_RATE_RPS, seed)
    runs = [run_policy(on_free_ports(settings, policy=policy, routing_seed=seed), reqs, speedup=1.0, time_scale=DEFAULT_TIME_SCALE,
                       progress=False)["figures"] for _ in range(repetitions)]
    pairs = [repeat_spread(a, b) for a, b in itertools.combinations(runs, 2)]
    largest = {k: max((p[k] for p in pairs if p[k] is not None), default=None) for k in SPREADS}
    return {"size": size, "policy": policy, "seed": seed, "runs": runs, "pairs": pairs, "largest": largest,
            "outside_tolerance": [within_tolerance(p) for p in pairs]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="60,400", help="comma-separated request counts")
    parser.add_argument("--policies", default="kappa", help="comma-separated policies (router.policies.POLICY_NAMES)")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write every run and spread here")
    args = parser.parse_args(argv)
    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        for policy in args.policies.split(","):
            result = measure(size, policy, args.repetitions, args.seed)
            results.append(result)
            splits = "; ".join(" / ".join(str(n) for n in r["backend_requests"].values()) for r in result["runs"])
            print(f"n={size} {policy}: splits {splits}; largest spread {json.dumps(result['largest'])}; "
                  f"pairs outside the tolerance: {sum(bool(o) for o in result['outside_tolerance'])}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"tolerances": [t.as_dict() for t in REPEAT_TOLERANCES], "results": results},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
