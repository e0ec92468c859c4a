"""A P/D run's figures for the demo: its splits, and the prefix hit ratio that does not count pulled KV.

A split request's decode answer reports ``cached_tokens`` = P − 1 (vLLM's convention: KV pulled
from the prefill backend counts as cached), so on a P/D fleet the answers' usage would make every
split a near-total cache hit. The hit ratio is taken instead from what the backends computed, their
own ``vllm:prompt_tokens_by_source_total{source="local_compute"}`` over the run
(`gateway.commands.demo.run_policy` scrapes it before and after): a prompt token no backend had to
prefill was found in some backend's cache (its HBM, its host tier, the shared KV pool). Each split
decode recomputes one token (vLLM recomputes the last prompt token), which is not a prefill and is
taken off. The KV pulled between backends is shown apart, ``kv_transferred_tokens``, from the
decode side's ``vllm:nixl_bytes_transferred``. Terms: `gateway.commands.demo_figures.DEFINITIONS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fleet_config.catalog import default_catalog
from fleet_config.settings import Settings
from gateway.commands.replay import RequestResult
from router import kappa
from router.profiles import Catalog

LOCAL_COMPUTE = 'vllm:prompt_tokens_by_source_total{source="local_compute"}'
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"  # the decode side's pulls: one observation per rank, bytes / TP each
RUN_COUNTERS = ("vllm:prompt_tokens_by_source", "vllm:nixl_")
"""Scraped before and after a run, and taken as the difference (`since`)."""


def since(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """``after`` with the `RUN_COUNTERS` samples made the run's increase (``after − before``)."""
    return {k: v - before.get(k, 0.0) if k.startswith(RUN_COUNTERS) else v for k, v in after.items()}


def prefilled_hit_ratio(prompt_tokens: float, computed_tokens: float | None, split_decodes: int) -> float | None:
    """``1 − (computed − split decodes) / prompt``, clamped to [0, 1]; None when unmeasured or no prompt."""
    if computed_tokens is None or not prompt_tokens:
        return None
    return min(1.0, max(0.0, 1.0 - (computed_tokens - split_decodes) / prompt_tokens))


def pd_run_hits(settings: Settings, ok: Sequence[RequestResult],
                backend_metrics: dict[str, dict[str, float]]) -> tuple[float | None, float | None]:
    """(prefix hit ratio, kv_transferred_tokens) of a P/D run from the backends' counters; either None
    when no backend's counter was scraped."""
    computed = [m[LOCAL_COMPUTE] for m in backend_metrics.values() if LOCAL_COMPUTE in m]
    splits = sum(r.prefill_backend is not None for r in ok)
    hit = prefilled_hit_ratio(sum(r.prompt_tokens or 0 for r in ok), sum(computed) if computed else None, splits)
    return hit, kv_transferred_tokens(settings, backend_metrics)


def backend_pd_hit(b_id: str, ok: Sequence[RequestResult], metrics: dict[str, float]) -> float | None:
    """One backend's prefix hit ratio on a P/D fleet: over the prompts it prefilled (requests it served
    whole, split requests it prefilled), its own computed tokens less one per split it decoded."""
    prompt = sum(r.prompt_tokens or 0 for r in ok if (r.backend == b_id and r.prefill_backend is None)
                 or r.prefill_backend == b_id)
    decodes = sum(r.backend == b_id and r.prefill_backend is not None for r in ok)
    return prefilled_hit_ratio(prompt, metrics.get(LOCAL_COMPUTE), decodes)


def kv_transferred_tokens(settings: Settings, backend_metrics: dict[str, dict[str, float]],
                          catalog: Catalog | None = None) -> float | None:
    """KV pulled between backends over the run, in tokens (bytes / the model's B_kv); None if unscraped."""
    catalog = catalog or default_catalog()
    total, seen = 0.0, False
    for b in settings.backends:
        m = backend_metrics.get(b.id, {})
        if NIXL_BYTES in m:
            seen = True
            total += m[NIXL_BYTES] / kappa.b_kv_bytes(settings.backend_spec(catalog, b).model)
    return round(total) if seen else None


def pd_figures(settings: Settings, results: Sequence[RequestResult],
               gateway_metrics: dict[str, float]) -> dict[str, Any] | None:
    """A P/D fleet's splits (`DEFINITIONS` ``split_share``, ``splits_per_pair``); None when no backend has a
    role other than ``both`` (`fleet_config.Settings.disaggregated`).

    Returns:
        ``splits``, ``split_share`` in [0,1] (of the successful requests; null without one),
        ``splits_counted_by_gateway`` (``gateway_pd_splits_total``, null when not scraped),
        ``prefill_fallbacks`` (``gateway_pd_prefill_fallbacks_total``: splits that went whole),
        ``pairs``: [{``prefill_backend``, ``decode_backend``, ``splits``}] by count, most first.
    """
    if not settings.disaggregated:
        return None
    ok = [r for r in results if r.error is None]
    pairs: dict[tuple[str, str], int] = {}
    for r in ok:
        if r.prefill_backend is not None and r.backend is not None:
            pairs[(r.prefill_backend, r.backend)] = pairs.get((r.prefill_backend, r.backend), 0) + 1
    splits = sum(pairs.values())
    return {
        "splits": splits, "split_share": splits / len(ok) if ok else None,
        "splits_counted_by_gateway": gateway_metrics.get("gateway_pd_splits_total"),
        "prefill_fallbacks": int(gateway_metrics.get("gateway_pd_prefill_fallbacks_total", 0.0)),
        "pairs": [{"prefill_backend": p, "decode_backend": d, "splits": n}
                  for (p, d), n in sorted(pairs.items(), key=lambda kv: (-kv[1], kv[0]))],
    }
