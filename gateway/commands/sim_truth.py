"""``kappa-gateway sim --fleet-truth FILE``: the simulator lies to the router, and measurement must catch it.

The engines run the truth fleet's backends (same ids: `sim.fleet.fleet_with_truth`); the router is
configured from ``--fleet`` and sees only what it would live — scraped metrics (the engines'
prefill-time histogram among them) and its own timings — and moves its specs by what it measures
(`dispatch.measured`, `sim.measure`). Three runs per policy, on the same requests:

- ``uncorrected``: the configured figures, measurement off (the router believes the config);
- ``corrected``: the configured figures, measurement on (the config's ``routing.measured_figures``,
  enabled whatever the file says);
- ``truth``: the router configured from the truth fleet itself, measurement off: the routing a
  right config would give, the target for ``corrected``.

The truth file's KV pool follows the configured fleet's: without one there, none (its per-backend
pool links are dropped); with one, the configured capacity and the truth's links.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fleet_config.catalog import default_catalog
from fleet_config.sections import KvPoolSection
from fleet_config.settings import Settings, load_settings
from router.link_factors import FACTORS
from sim.fleet import Fleet, fleet_from_settings, fleet_with_truth
from sim.report import DEFAULT_TTFT_SLO_S, policy_report
from sim.runner import SimJob, run_jobs, scale_rate
from sim.simulator import SimResult

VARIANTS = ("uncorrected", "corrected", "truth")


def aligned_truth(truth: Settings, configured: Settings) -> Settings:
    """``truth`` with the configured fleet's KV pool (module docstring)."""
    if configured.kv_pool is None:
        backends = [b.model_copy(update={"kv_pool_link_gb_s": None}) for b in truth.backends]
        return truth.model_copy(update={"kv_pool": None, "backends": backends})
    pool = KvPoolSection(capacity_gb=configured.kv_pool.capacity_gb,
                         link_gb_s_per_gpu=(truth.kv_pool or configured.kv_pool).link_gb_s_per_gpu)
    return truth.model_copy(update={"kv_pool": pool})


def truth_fleets(configured: Settings, truth: Settings) -> dict[str, Fleet]:
    """The three fleets of the runs, by variant (module docstring)."""
    catalog = default_catalog()
    told = fleet_from_settings(configured, catalog)
    real = fleet_from_settings(aligned_truth(truth, configured), catalog)
    lied_to = fleet_with_truth(told, real)
    measuring = dataclasses.replace(told.measurement, enabled=True)
    return {"uncorrected": dataclasses.replace(lied_to, measurement=dataclasses.replace(measuring, enabled=False)),
            "corrected": dataclasses.replace(lied_to, measurement=measuring),
            "truth": dataclasses.replace(real, measurement=dataclasses.replace(measuring, enabled=False))}


def true_factors(fleet: Fleet) -> dict[str, dict[str, float | None]]:
    """Per backend of a lied-to fleet, the factors a perfect measurement would read (truth seconds over
    configured ones, by resource) and the truth's linear κ_crit at its host link."""
    out: dict[str, dict[str, float | None]] = {}
    for b in fleet.backends:
        told, real = b.spec, b.engine_spec
        pool = (told.kv_pool_link_bytes_per_s / real.kv_pool_link_bytes_per_s
                if told.kv_pool_link_bytes_per_s and real.kv_pool_link_bytes_per_s else None)
        ratios = (told.c_eff_flops_per_s / real.c_eff_flops_per_s, told.link_bytes_per_s / real.link_bytes_per_s,
                  pool, told.hbm_bandwidth_bytes_per_s / real.hbm_bandwidth_bytes_per_s)
        out[b.id] = dict(zip(FACTORS, ratios, strict=True)) | {"kappa_crit_linear": real.kappa_crit_linear}
    return out


def run_truth_sim(requests: list[Any], fleet: Path, truth: Path, policies: list[str], *, rate_scale: float,
                  seed: int, kv_pool_gb: float | None, workers: int | None = 1,
                  ttft_slo_s: float = DEFAULT_TTFT_SLO_S) -> dict[str, Any]:
    """Each policy in each variant on ``requests`` (`sim.traces.TraceRequest`s at rate scale 1).

    Returns:
        ``{"policies": {policy: {variant: sim.report.policy_report(...)}}, "measured": {policy:
        {backend: sim.measure.measured_figures(...)}}, "true_factors": {backend: ...},
        "corrected_over_truth_ttft_p90": {policy: ratio}, "run": {...}}``.

    Raises:
        fleet_config.ConfigError: a bad fleet file. ValueError: the two fleets' backends differ.
    """
    started = time.perf_counter()
    catalog = default_catalog()
    configured = load_settings(fleet, catalog, env={})
    if kv_pool_gb is not None:
        configured = configured.model_copy(update={"kv_pool": KvPoolSection(capacity_gb=kv_pool_gb)})
    fleets = truth_fleets(configured, load_settings(truth, catalog, env={}))
    requests = scale_rate(requests, rate_scale)
    jobs = [SimJob(variant, name, 1.0, dict(configured.routing.params) if name == configured.routing.policy else {})
            for name in policies for variant in VARIANTS]
    results = run_jobs(requests, fleets, jobs, seed=seed, workers=workers)
    by: dict[str, dict[str, SimResult]] = {}
    for job, result in zip(jobs, results, strict=True):
        by.setdefault(job.policy, {})[job.fleet] = result
    reports = {p: {v: policy_report(r, ttft_slo_s=ttft_slo_s) for v, r in runs.items()} for p, runs in by.items()}
    return {
        "policies": reports,
        "measured": {p: runs["corrected"].measured for p, runs in by.items()},
        "true_factors": true_factors(fleets["corrected"]),
        "corrected_over_truth_ttft_p90": {p: _ratio(r["corrected"]["ttft_p90_s"], r["truth"]["ttft_p90_s"])
                                          for p, r in reports.items()},
        "run": {"fleet": str(fleet), "fleet_truth": str(truth), "requests": len(requests), "rate_scale": rate_scale,
                "seed": seed, "kv_pool_gb": configured.kv_pool.capacity_gb if configured.kv_pool else None,
                "wall_s": round(time.perf_counter() - started, 1)},
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _f(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def print_truth_report(report: dict[str, Any], console: Console) -> None:
    """The three variants per policy (TTFT p50/p90/p99, E2E p90), then measured against true factors."""
    console = Console(width=max(console.width, 170))
    run = report["run"]
    table = Table(title=f"kappa-gateway sim --fleet-truth: {run['requests']} requests, rate ×{run['rate_scale']:g}, "
                        f"router told {run['fleet']}, engines run {run['fleet_truth']}"
                        + (f", {run['kv_pool_gb']:g} GB KV pool" if run["kv_pool_gb"] else "") + f", {run['wall_s']} s")
    for col in ("policy", "variant", "TTFT p50", "p90", "p99", "E2E p90", "corrected/truth p90"):
        table.add_column(col, justify="left" if col in ("policy", "variant") else "right", no_wrap=True)
    for name, variants in report["policies"].items():
        for variant, p in variants.items():
            ratio = report["corrected_over_truth_ttft_p90"][name] if variant == "corrected" else None
            table.add_row(name, variant, _f(p["ttft_p50_s"], ".3f"), _f(p["ttft_p90_s"], ".3f"),
                          _f(p["ttft_p99_s"], ".3f"), _f(p["e2e_p90_s"], ".2f"), _f(ratio, ".3f"))
    console.print(table)
    figures = Table(title="measured over configured seconds (the corrected run's last fit) against the truth's")
    for col in ("policy", "backend", *FACTORS, "κ_crit host: measured / truth"):
        figures.add_column(col, justify="left" if col in ("policy", "backend") else "right", no_wrap=True)
    for name, measured in report["measured"].items():
        for backend, m in measured.items():
            truth = report["true_factors"][backend]
            cells = [f"{_f((m['factors'][k] or {}).get('time_ratio'), '.3g')} / {_f(truth[k], '.3g')}"
                     for k in FACTORS]
            figures.add_row(name, backend, *cells, f"{_f(m['kappa_crit_linear_measured'], '.3g')} / "
                                                    f"{_f(truth['kappa_crit_linear'], '.3g')}")
    console.print(figures)
