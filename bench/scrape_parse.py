"""CPU of reading one backend's ``/metrics`` page (`gateway.backends.scrape.parse_vllm_metrics`), side by side.

The page is the mock vLLM server's (``mock_vllm/metrics.py``: vLLM's v1 families, histogram
buckets and all, every bucket of every histogram printed). Two ways to read it, interleaved in
each round: **whole page** (prometheus-client's parser on every line) and **lines read** (only
the samples the gateway reads go to the parser, as `parse_vllm_metrics` does). Both must give
the same figures; the script checks it. Medians of ``--rounds`` rounds of ``--calls`` calls
each, in ms per page; the ratio is per round, then its median.

    python bench/scrape_parse.py [--rounds 7] [--calls 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

import hot_path  # noqa: E402

hot_path.select()  # this script is an entry point: compiled or source, before the project is imported

from fleet_config import default_catalog
from gateway.backends.scrape import parse_vllm_metrics, read_families
from mock_vllm.app_factory import idle_metrics_page


def per_call_ms(fn, text: str, calls: int) -> float:  # type: ignore[no-untyped-def]
    started = time.process_time()
    for _ in range(calls):
        fn(text)
    return (time.process_time() - started) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    text = idle_metrics_page("llama-3.1-8b", "h100-sxm", default_catalog())

    def whole(page: str) -> object:
        return read_families(text_string_to_metric_families(page))

    assert whole(text) == parse_vllm_metrics(text), "the two ways disagree"
    rows: dict[str, list[float]] = {"whole page": [], "lines read": []}
    for r in range(args.rounds):
        order = [("whole page", whole), ("lines read", parse_vllm_metrics)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            rows[name].append(per_call_ms(fn, text, args.calls))
    ratios = [w / n for w, n in zip(rows["whole page"], rows["lines read"], strict=True)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
                            cwd=Path(__file__).parent).stdout.strip()
    result = {"page_bytes": len(text), "page_lines": text.count("\n"), "rounds": args.rounds, "calls": args.calls,
              "ms_per_page_median": {k: round(statistics.median(v), 4) for k, v in rows.items()},
              "whole_over_lines_read_median": round(statistics.median(ratios), 2), "commit": commit,
              "command": "python bench/scrape_parse.py" + (" --json" if args.json else "")}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"mock vLLM page: {result['page_bytes']} bytes, {result['page_lines']} lines")
    for name, ms in result["ms_per_page_median"].items():
        print(f"  {name:10}  {ms:.3f} ms per page")
    print(f"  whole page / lines read: {result['whole_over_lines_read_median']}x (median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
