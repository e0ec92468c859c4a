"""Summaries of replay results: percentiles, totals, per-backend and regime splits, the printed table."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gateway.commands.replay import ERROR_EXAMPLES, QUEUED_THRESHOLD_S, RequestResult
from sim.report import percentile


def summarize(results: Sequence[RequestResult]) -> dict[str, Any]:
    """Aggregate results into a JSON-ready summary (times in s, rates in requests/s).

    Returns:
        ``requests``, ``ok``, ``errors``, ``error_examples`` (up to 5 ``{"error", "count"}``),
        ``duration_s`` (first send → last end), ``throughput_rps`` (successes / duration),
        ``ttft_p50_s``/``p90``/``p99``, ``e2e_p50_s``/``p90``, ``itl_mean_s``, token totals
        and ``cached_token_ratio`` (Σcached / Σprompt), client-side queueing counts, and
        ``backends`` / ``regimes`` (empty without ``x-kappa-*`` headers).
    """
    ok = [r for r in results if r.ok]
    failed = Counter(r.error for r in results if not r.ok)
    ends = [r.sent_s + (r.e2e_s or 0.0) for r in results]
    duration_s = max(ends) - min(r.sent_s for r in results) if results else 0.0
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2es = [r.e2e_s for r in ok if r.e2e_s is not None]
    itls = [r.itl_s for r in ok if r.itl_s is not None]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    queued = [r.queue_wait_s for r in results if r.queue_wait_s > QUEUED_THRESHOLD_S]
    backends: dict[str, dict[str, Any]] = {}
    for r in results:
        if r.backend is None:
            continue
        entry = backends.setdefault(r.backend, {"requests": 0, "errors": 0, "regimes": Counter()})
        entry["requests"] += 1
        entry["errors"] += not r.ok
        if r.regime:
            entry["regimes"][r.regime] += 1
    return {
        "requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
        "error_examples": [{"error": e, "count": n} for e, n in failed.most_common(ERROR_EXAMPLES)],
        "duration_s": duration_s, "throughput_rps": len(ok) / duration_s if duration_s > 0 else None,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90), "ttft_p99_s": percentile(ttfts, 99),
        "e2e_p50_s": percentile(e2es, 50), "e2e_p90_s": percentile(e2es, 90),
        "itl_mean_s": sum(itls) / len(itls) if itls else None,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "completion_tokens": sum(r.completion_tokens or 0 for r in ok),
        "cached_token_ratio": cached / prompt if prompt else None,
        "client_queued_requests": len(queued), "client_queue_wait_max_s": max(queued, default=0.0),
        "regimes": dict(Counter(r.regime for r in results if r.regime)),
        "backends": {b: {**e, "regimes": dict(e["regimes"])} for b, e in sorted(backends.items())},
    }


def _fmt(summary: dict[str, Any], keys: str, unit: str = " s") -> str:
    values = [summary[k] for k in keys.split()]
    return " / ".join("–" if v is None else f"{v:.4g}{unit}" if isinstance(v, float) else f"{v:,}" for v in values)


def print_summary(summary: dict[str, Any], console: Console, *, concurrency: int) -> None:
    """Render `summarize`'s output as rich tables (overall, then per backend when known)."""
    table = Table("metric", "value", title="replay summary", show_header=False)
    table.columns[1].justify = "right"
    for name, keys, unit in [
        ("requests / ok / errors", "requests ok errors", ""), ("duration", "duration_s", " s"),
        ("throughput", "throughput_rps", " req/s"), ("TTFT p50 / p90 / p99", "ttft_p50_s ttft_p90_s ttft_p99_s", " s"),
        ("E2E p50 / p90", "e2e_p50_s e2e_p90_s", " s"), ("ITL mean", "itl_mean_s", " s"),
        ("prompt / cached / completion tokens", "prompt_tokens cached_tokens completion_tokens", ""),
        ("cached-token ratio", "cached_token_ratio", ""),
    ]:
        table.add_row(name, _fmt(summary, keys, unit))
    regimes = ", ".join(f"{k} {v:,}" for k, v in sorted(summary["regimes"].items()))
    table.add_row("regimes", regimes or "– (no x-kappa headers)")
    console.print(table)
    if summary["backends"]:
        per = Table("backend", "requests", "errors", "compute", "transfer", title="per backend")
        for name, e in summary["backends"].items():
            per.add_row(name, *(f"{n:,}" for n in (e["requests"], e["errors"], e["regimes"].get("compute", 0),
                                                    e["regimes"].get("transfer", 0))))
        console.print(per)
    if summary["client_queued_requests"]:
        console.print(f"client-side queueing: {summary['client_queued_requests']:,} requests waited for one of "
                      f"{concurrency} slots (max {summary['client_queue_wait_max_s']:.3f} s); latencies run from "
                      "the send, so raise --concurrency to load the server harder.")
    for example in summary["error_examples"]:
        console.print(Text.assemble((f"error ×{example['count']}: ", "red"), example["error"]))
