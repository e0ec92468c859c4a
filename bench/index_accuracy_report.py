"""The figures of `bench/index_accuracy.py`: per request, per run, per mode (medians of the runs).

Per request (`request_rows`): the prediction the gateway routed on, ``predicted`` = K on the chosen
backend (its access log's ``cached_tokens``: HBM + host tier + KV pool credit,
`router.types.Candidate.cached_tokens`), and what the engine reported, ``reported`` =
``usage.prompt_tokens_details.cached_tokens``; ``error`` = predicted − reported, tokens. A request is
*within one block* when |error| ≤ the block: the engine's (16 tokens, vLLM's default and the mock's)
or the approximate index's (64 tokens, ``index.block_size_tokens``); *over* / *under* when it is
outside it, credited more / less than the engine found. Each is also attributed the KV-event mode
its backend showed when it was sent (`index_accuracy_probe.ModePoller.mode_at`).

Per run (`summarise_run`): those shares and counts over the successful requests; MAE (mean |error|,
tokens); TTFT p50/p90 and E2E p90 in modelled seconds (wall / time scale); the prefix hit ratio
Σ reported / Σ prompt tokens; errors; the gateway's own counter (``gateway_index_predictions_total``:
within one *index* block at the calibrated bytes per token); evictions (blocks the engines removed,
from their KV events); CPU seconds of the gateway and the mock fleet.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from gateway.commands.replay import RequestResult
from sim.report import percentile

ENGINE_BLOCK_TOKENS = 16
INDEX_BLOCK_TOKENS = 64
MISS_ROWS_KEPT = 300  # per run, in the JSON: enough to read the causes, not every row of a bad run
FIGURES = ("within_16_share", "within_64_share", "gateway_within_index_block_share", "mae_tokens", "over_16", "under_16",
           "over_64", "under_64", "ttft_p50_s", "ttft_p90_s", "e2e_p90_s", "prefix_hit_ratio", "errors",
           "exact_routed", "evicted_gpu_blocks", "evicted_cpu_blocks", "gateway_cpu_s", "mocks_cpu_s")


def request_rows(results: Sequence[RequestResult], access: dict[str, dict[str, Any]], meta: dict[str, list[int]],
                 mode_at: Callable[[str, float], str | None], start_s: float, time_scale: float) -> list[dict[str, Any]]:
    """One row per request (the module docstring); ``mode_at(backend, monotonic_s)`` -> mode or None."""
    rows = []
    for r in results:
        record = access.get(r.request_id or "", {})
        predicted, reported = record.get("cached_tokens"), r.cached_tokens
        rows.append({
            "index": r.index, "tenant": meta["tenant"][r.index], "conversation": meta["conversation"][r.index],
            "turn": meta["turn"][r.index], "ok": r.ok, "error_text": r.error, "backend": r.backend,
            "sent_s": r.sent_s, "ttft_wall_s": r.ttft_s, "ttft_s": None if r.ttft_s is None else r.ttft_s / time_scale,
            "e2e_s": None if r.e2e_s is None else r.e2e_s / time_scale,
            "prompt_tokens": r.prompt_tokens, "reported": reported, "predicted": predicted,
            "uncached_predicted": record.get("uncached_prompt_tokens"),
            "error": predicted - reported if predicted is not None and reported is not None else None,
            "mode": mode_at(r.backend, start_s + r.sent_s) if r.backend else None,
        })
    _mark_prefilling_peers(rows)
    return rows


def _mark_prefilling_peers(rows: list[dict[str, Any]]) -> None:
    """``peer_prefilling`` / ``other_prefilling``: when the row was sent, a request of the same tenant
    sent earlier to the same backend / to another backend had not yet had its first token (its prefill,
    and so its blocks, may still have been running there; and another backend writes what it prefills
    through to the KV pool chunk by chunk, before the gateway records it at the first token)."""
    earlier: dict[Any, list[dict[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: r["sent_s"]):
        running = [p for p in earlier.get(row["tenant"], [])
                   if p["ttft_wall_s"] is not None and p["sent_s"] + p["ttft_wall_s"] > row["sent_s"]]
        row["peer_prefilling"] = any(p["backend"] == row["backend"] for p in running)
        row["other_prefilling"] = any(p["backend"] != row["backend"] for p in running)
        earlier.setdefault(row["tenant"], []).append(row)


def summarise_run(rows: Sequence[dict[str, Any]], extra: dict[str, Any], *, all_rows: bool = False) -> dict[str, Any]:
    """One run's figures (module docstring); ``extra`` holds what the runner measured beside the rows;
    ``all_rows``: keep every row (``rows``), not only the first `MISS_ROWS_KEPT` misses."""
    ok = [r for r in rows if r["ok"]]
    judged = [r for r in ok if r["error"] is not None]
    errs = [r["error"] for r in judged]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    e2e = [r["e2e_s"] for r in ok if r["e2e_s"] is not None]
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    n = len(judged)
    out: dict[str, Any] = {
        "requests": len(rows), "errors": len(rows) - len(ok), "judged": n,
        "error_examples": sorted({r["error_text"] for r in rows if r["error_text"]})[:3],
        "within_16_share": sum(abs(e) <= ENGINE_BLOCK_TOKENS for e in errs) / n if n else None,
        "within_64_share": sum(abs(e) <= INDEX_BLOCK_TOKENS for e in errs) / n if n else None,
        "mae_tokens": statistics.fmean(abs(e) for e in errs) if errs else None,
        "over_16": sum(e > ENGINE_BLOCK_TOKENS for e in errs), "under_16": sum(e < -ENGINE_BLOCK_TOKENS for e in errs),
        "over_64": sum(e > INDEX_BLOCK_TOKENS for e in errs), "under_64": sum(e < -INDEX_BLOCK_TOKENS for e in errs),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90), "e2e_p90_s": percentile(e2e, 90),
        "prefix_hit_ratio": sum(r["reported"] or 0 for r in ok) / prompt if prompt else None,
        "exact_routed": sum(r["mode"] == "exact" for r in ok),
        "routed_by_mode": _count(r["mode"] or "unknown" for r in ok),
        "per_backend": _count(r["backend"] or "none" for r in ok),
        "within_16_share_by_mode": {m: _share(r for r in judged if (r["mode"] or "unknown") == m)
                                    for m in _count(r["mode"] or "unknown" for r in judged)},
        **extra,
    }
    misses = [r for r in judged if abs(r["error"]) > ENGINE_BLOCK_TOKENS]
    out["misses_16"] = _miss_causes(misses)
    out["miss_rows"] = misses[:MISS_ROWS_KEPT]
    if all_rows:
        out["rows"] = list(rows)
    return out


def _share(rows: Any) -> float | None:
    rows = list(rows)
    return sum(abs(r["error"]) <= ENGINE_BLOCK_TOKENS for r in rows) / len(rows) if rows else None


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))


def _miss_causes(misses: Sequence[dict[str, Any]]) -> dict[str, int]:
    """The misses (|error| > 16) by what was true of them: over or under, the backend's mode, a same-tenant
    request still prefilling on that backend or on another when sent, and the turn (a follow-up or a first
    question)."""
    return {
        "total": len(misses), "over": sum(r["error"] > 0 for r in misses), "under": sum(r["error"] < 0 for r in misses),
        "not_exact_mode": sum(r["mode"] != "exact" for r in misses),
        "peer_prefilling": sum(bool(r["peer_prefilling"]) for r in misses),
        "other_prefilling": sum(bool(r["other_prefilling"]) for r in misses),
        "followups": sum(r["turn"] > 1 for r in misses),
    }


def summarise_modes(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per mode and figure: the median over the runs and its [min, max]."""
    out: dict[str, dict[str, Any]] = {}
    for mode, reps in runs.items():
        row: dict[str, Any] = {"runs": len(reps)}
        for fig in FIGURES:
            values = [r[fig] for r in reps if r.get(fig) is not None]
            row[fig] = statistics.median(values) if values else None
            row[fig + "_range"] = [min(values), max(values)] if values else None
        out[mode] = row
    return out
