"""``kappa-gateway analyze``: what a workload allows and what it costs, before and after deploying.

For a trace (`sim.traces.load_trace`), a named workload (`sim.workloads`; the chat workloads with
their messages) or the gateway's own access log (`gateway.edge.access_log`, JSON or text lines):

- the hit ratio the workload allows — an infinite prefix cache shared by the fleet
  (`sim.analysis.shareable_tokens`) — and the κ_ratio distribution at that K;
- the tokens lost to prefix invalidation, by cause (`prefix_index.invalidation`, the detector
  the gateway runs live), and the hit ratio the workload would allow had its contexts only
  been appended to;
- per backend of a fleet config (or per catalog hardware with ``--hardware``): the share of
  requests that would be transfer-bound with their K loaded from the host tier
  (`router.cost.predict`'s regime; a config backend's K is what its host tier holds,
  `sim.analysis.host_tier_tokens`; catalog hardware's, the workload's allowed K unless
  ``--host-tier-gb``), and what-ifs: an FP8 KV cache (B_kv halved: `ModelProfile.kv_dtype_bytes`
  = 1, so the host tier holds twice the tokens and loads move half the bytes), a measured
  sustained host link (``--link-gb-s``, the TP group's, as ``host_link_gb_s`` in a config) and
  a larger host tier (``--host-tier-gb``).

The access log carries no prompt hashes: from it the hit ratio the workload allows and the host
tier what-if cannot be computed, and K is what the gateway routed with (its estimate on the
chosen backend); the report says so in ``notes``. A KV pool is not priced: loads cross the
host link.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from fleet_config import Settings
from gateway.edge.access_log import FIELDS as ACCESS_LOG_FIELDS
from prefix_index import INVALIDATION_CAUSES
from router import kappa
from router.cost import BackendSpec
from router.profiles import GB, Catalog, ModelProfile
from sim.analysis import (
    PromptView,
    host_tier_tokens,
    kappa_ratio_percentiles,
    prompt_views,
    regime_figures,
    shareable_tokens,
)
from sim.traces import TraceRequest, load_trace
from sim.workloads import WORKLOADS, build_workload

DEFAULT_WORKLOAD_REQUESTS = 2_000
"""Requests of a named workload without ``--requests``: ~8 minutes of chat at 4 requests/s."""
FP8_KV_DTYPE_BYTES = 1
"""An FP8 KV cache: one byte per element (vLLM ``--kv-cache-dtype fp8``)."""


@dataclass(frozen=True, slots=True)
class Row:
    """One backend (or catalog hardware) to price: its spec and host tier (GB; None: unbounded)."""

    name: str
    hardware: str
    spec: BackendSpec
    host_tier_gb: float | None


def config_rows(settings: Settings, catalog: Catalog) -> list[Row]:
    """Every backend of the config, with its own host tier."""
    return [Row(b.id, b.hardware, settings.backend_spec(catalog, b), b.host_tier_gb) for b in settings.backends]


def hardware_rows(catalog: Catalog, model: ModelProfile, names: Sequence[str], *, tensor_parallel: int = 1) -> list[Row]:
    """Catalog hardware (``all``: every entry) running ``model``, host tier unbounded.

    Raises:
        router.errors.ProfileError: an unknown hardware name.
    """
    names = list(catalog.hardware) if "all" in names else list(names)
    return [Row(n, n, BackendSpec(model=model, hardware=catalog.hw(n), tensor_parallel=tensor_parallel), None)
            for n in names]


def respec(spec: BackendSpec, *, model: ModelProfile | None = None, host_link_gb_s: float | None = None) -> BackendSpec:
    """``spec`` with another model profile or a measured host link (GB/s, the TP group's)."""
    return BackendSpec(model=model or spec.model, hardware=spec.hardware, power_cap_w=spec.power_cap_w,
                       tensor_parallel=spec.tensor_parallel,
                       host_link_gb_s=host_link_gb_s if host_link_gb_s is not None else spec.host_link_gb_s,
                       overlap_host_load=spec.overlap_host_load, kv_pool_link_gb_s=spec.kv_pool_link_gb_s)


def fp8_kv(spec: BackendSpec) -> BackendSpec:
    """``spec`` with an FP8 KV cache (`FP8_KV_DTYPE_BYTES`): B_kv halved for a 2-byte cache."""
    return respec(spec, model=spec.model.model_copy(update={"kv_dtype_bytes": FP8_KV_DTYPE_BYTES}))


def load_requests(trace: Path | None, workload: str | None, requests: int | None, seed: int) -> list[TraceRequest]:
    """The trace's first ``requests`` records (all: None), or a named workload's (with its chat
    messages where it has them).

    Raises:
        ValueError: an unknown workload or a bad trace (the message names it).
    """
    if trace is not None:
        return load_trace(trace, limit=requests)
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r} (known: {', '.join(WORKLOADS)})")
    n = DEFAULT_WORKLOAD_REQUESTS if requests is None else requests
    try:
        return build_workload(workload, n, seed, messages=WORKLOADS[workload].build_messages is not None)
    except FileNotFoundError as exc:  # a real-trace workload on a machine without shared/data
        raise ValueError(str(exc)) from exc


def analyze_views(views: Sequence[PromptView], rows: Sequence[Row], *, link_gb_s: float | None = None,
                  host_tier_gb: float | None = None) -> dict[str, Any]:
    """The report of a trace or workload (module docstring), JSON-ready.

    Returns:
        ``{"workload": {...}, "invalidation": {...}, "backends": [...], "notes": [...]}``: hit ratios
        in [0, 1], tokens in the trace's tokens, κ figures as `sim.analysis.RegimeFigures.as_dict`.
    """
    prompts = [v.prompt_tokens for v in views]
    outputs = [v.output_tokens for v in views]
    allowed = shareable_tokens(views)
    findings = [None if v.finding is None else (v.finding.cause, v.finding.invalidated_tokens) for v in views]
    invalidation = invalidation_summary(findings, sum(prompts))
    total = sum(prompts)
    workload = {
        "requests": len(views), "prompt_tokens": total,
        "hit_ratio_allowed": sum(allowed) / total if total else 0.0,
        "hit_ratio_append_only": (sum(allowed) + invalidation["invalidated_tokens"]) / total if total else 0.0,
        "kappa_ratio": kappa_ratio_percentiles(allowed, prompts),
    }
    hits: dict[float, list[int]] = {}

    def figures(spec: BackendSpec, tier_gb: float | None) -> dict[str, Any]:
        capacity = float("inf") if tier_gb is None else tier_gb * GB / kappa.b_kv_bytes(spec.model)
        if capacity not in hits:
            hits[capacity] = host_tier_tokens(views, capacity)
        return {"host_tier_gb": tier_gb, **regime_figures(hits[capacity], prompts, outputs, spec).as_dict()}

    backends = [_row_report(row, figures, link_gb_s, host_tier_gb) for row in rows]
    notes = [] if invalidation["available"] else [
        "no request carries chat messages: prefix invalidation needs them (a ShareGPT trace, a chat "
        "workload, or the gateway's access log)"]
    return {"workload": workload, "invalidation": invalidation, "backends": backends, "notes": notes}


def _row_report(row: Row, figures: Any, link_gb_s: float | None, host_tier_gb: float | None) -> dict[str, Any]:
    spec = row.spec
    what_if: dict[str, Any] = {"fp8_kv": figures(fp8_kv(spec), row.host_tier_gb)}
    if link_gb_s is not None:
        what_if["link_gb_s"] = {"link_gb_s": link_gb_s, **figures(respec(spec, host_link_gb_s=link_gb_s), row.host_tier_gb)}
    if host_tier_gb is not None:
        what_if["host_tier_gb"] = figures(spec, host_tier_gb)
    return {"name": row.name, "hardware": row.hardware, "tensor_parallel": spec.tensor_parallel,
            "link_gb_s": spec.link_bytes_per_s / GB, "b_kv_bytes": kappa.b_kv_bytes(spec.model),
            "kappa_crit_linear": spec.kappa_crit_linear, "baseline": figures(spec, row.host_tier_gb), "what_if": what_if}


def invalidation_summary(findings: Sequence[tuple[str | None, int] | None], prompt_tokens: int) -> dict[str, Any]:
    """Tokens and requests by cause, from each request's ``(cause, invalidated tokens)`` (None: the
    request has no finding; ``available``: any has one)."""
    tokens: Counter[str] = Counter()
    requests: Counter[str] = Counter()
    available = False
    for finding in findings:
        if finding is None:
            continue
        available = True
        cause, lost = finding
        if cause is not None:
            tokens[cause] += lost
            requests[cause] += 1
    total = sum(tokens.values())
    return {"available": available, "invalidated_tokens": total,
            "prompt_token_share": total / prompt_tokens if prompt_tokens else 0.0,
            "by_cause": {c: {"requests": requests[c], "tokens": tokens[c]} for c in INVALIDATION_CAUSES}}


def read_access_log(path: Path) -> list[dict[str, Any]]:
    """The access-log records of a file: JSON lines (``access_log_format: json``) or the text format's
    ``key=value`` lines (``-``: absent), other lines skipped.

    Raises:
        OSError: the file cannot be read.
    """
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        start = line.find("{")
        if start >= 0:
            try:
                record = orjson.loads(line[start:])
            except orjson.JSONDecodeError:
                continue
            if isinstance(record, dict) and "request_id" in record and "route" in record:
                out.append(record)
            continue
        at = line.find("ts=")
        if at < 0 or " request_id=" not in line:
            continue
        record = {}
        for pair in line[at:].split(" "):
            key, sep, value = pair.partition("=")
            if sep and key in ACCESS_LOG_FIELDS:
                record[key] = None if value == "-" else _number(value)
        out.append(record)
    return out


def _number(value: str) -> Any:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def analyze_access_log(records: Sequence[dict[str, Any]], rows: Sequence[Row], *,
                       link_gb_s: float | None = None) -> dict[str, Any]:
    """The report of an access log (module docstring): answered requests only (``outcome`` ok)."""
    ok = [r for r in records if r.get("outcome") == "ok" and isinstance(r.get("cached_tokens"), (int, float))
          and isinstance(r.get("uncached_prompt_tokens"), (int, float))]
    cached = [float(r["cached_tokens"]) for r in ok]
    prompts = [float(r["cached_tokens"] + r["uncached_prompt_tokens"]) for r in ok]
    outputs = [1.0] * len(ok)  # the log has no output tokens: regimes need only the prefill
    total = sum(prompts)
    has_fields = any("invalidated_tokens" in r for r in records)
    findings = [(r.get("invalidation_cause"), r.get("invalidated_tokens") or 0)
                if r.get("route") == "chat" and r.get("invalidated_tokens") is not None else None for r in ok]
    routed: dict[str, list[str]] = {}
    for r in ok:
        routed.setdefault(str(r.get("backend")), []).append(str(r.get("regime")))
    backends = []
    for row in rows:
        what_if = {"fp8_kv": regime_figures(cached, prompts, outputs, fp8_kv(row.spec)).as_dict()}
        if link_gb_s is not None:
            what_if["link_gb_s"] = {"link_gb_s": link_gb_s, **regime_figures(
                cached, prompts, outputs, respec(row.spec, host_link_gb_s=link_gb_s)).as_dict()}
        regimes = routed.get(row.name, [])
        backends.append({"name": row.name, "hardware": row.hardware, "tensor_parallel": row.spec.tensor_parallel,
                         "link_gb_s": row.spec.link_bytes_per_s / GB, "b_kv_bytes": kappa.b_kv_bytes(row.spec.model),
                         "kappa_crit_linear": row.spec.kappa_crit_linear, "routed_requests": len(regimes),
                         "routed_transfer_bound_share": regimes.count("transfer") / len(regimes) if regimes else None,
                         "baseline": {"host_tier_gb": None, **regime_figures(cached, prompts, outputs, row.spec).as_dict()},
                         "what_if": what_if})
    notes = ["the access log has no prompt hashes: the hit ratio the workload allows and the host-tier what-if "
             "need a trace; K here is what the gateway routed with (its estimate on the chosen backend)",
             "every request is priced with its K loaded from the host tier, on every row"]
    if not has_fields:
        notes.append("this log has no invalidated_tokens field (written before issue 27): no invalidation figures")
    return {"workload": {"requests": len(ok), "prompt_tokens": total, "hit_ratio_allowed": None,
                         "hit_ratio_as_routed": sum(cached) / total if total else 0.0,
                         "kappa_ratio": kappa_ratio_percentiles(cached, prompts)},
            "invalidation": invalidation_summary(findings, int(total)), "backends": backends, "notes": notes}
