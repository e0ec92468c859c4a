"""The demo's human-readable report (a rich table per backend, then where to look next)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _f(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _crit_p50(b: dict[str, Any]) -> str:
    if b["kappa_crit_p50"] is None and b["kappa_crit_never_requests"]:
        return "never"  # the median request cannot be transfer-bound there (x-kappa-crit: inf)
    return _f(b["kappa_crit_p50"], ".1f")


def _transfer(b: dict[str, Any]) -> str:
    return f"{b['regimes']['transfer']} ({_f(b['transfer_share'], '.0%')})"


def print_report(report: dict[str, Any], console: Console) -> None:
    """Print `gateway.commands.demo.build_report`'s dict for a person."""
    title = (f"kappa-gateway demo: {report['requests']} requests, {report['errors']} errors, policy "
             f"{report['policy']}, {report['wall_s']} s of wall time")
    table = Table(title=title, caption=report["workload"])
    for col in ("backend", "hardware", "κ_crit_lin", "reqs", "transfer", "κ p50", "κ p90", "κ_load p90",
                "κ_crit p50", f"T≥{report['large_t_threshold_tokens'] / 1e3:.1f}k", "hit", "TTFT p50", "TTFT p90", "kJ"):
        table.add_column(col, justify="left" if col in ("backend", "hardware") else "right", no_wrap=True)
    for b in report["backends"]:
        energy = None if b["energy_j"] is None else b["energy_j"] / 1e3
        table.add_row(
            b["id"], b["hardware"], f"{b['kappa_crit_linear']:.1f}", str(b["requests"]), _transfer(b),
            _f(b["kappa_ratio_p50"], ".2f"), _f(b["kappa_ratio_p90"], ".1f"), _f(b["kappa_ratio_loaded_p90"], ".1f"),
            _crit_p50(b), str(b["large_t_requests"]),
            _f(b["prefix_hit_ratio"], ".0%"), _f(b["ttft_p50_s"], ".3f"), _f(b["ttft_p90_s"], ".3f"), _f(energy, ".1f"))
    console = Console(width=max(console.width, 176))  # 14 columns, the hardware one wide
    console.print(table)
    roles = report.get("placement_by_role", {})
    if roles:
        console.print("Placement by role — share of each role's requests that are high-κ (κ_ratio > "
                      f"{report['high_kappa_threshold']:.1f}, the compute-dense backends' κ_crit_linear) / large-T: "
                      + "; ".join(
                          f"{role} {g['high_kappa_share']:.0%} / {g['large_t_share']:.0%}" for role, g in roles.items()))
    if report.get("kv_pool_gb"):
        loads = {b["id"]: b.get("kv_pool_loaded_bytes") or 0.0 for b in report["backends"]}
        console.print(f"Shared KV pool ({report['kv_pool_gb']:g} GB): prefixes loaded from it — " + ", ".join(
            f"{bid} {v / 1e9:,.1f} GB" for bid, v in loads.items()) + ".")
    measured = report.get("kappa_crit_measured") or {}
    if measured:
        console.print("Measured κ_crit (the backends' own prefill times against the profile: router/kappa_fit.py), "
                      "95% interval — " + "; ".join(
                          f"{bid} {m['value']:.3g} [{m['ci'][0]:.3g}, {m['ci'][1]:.3g}] from {m['load_requests']} "
                          "load-bound requests" if m["value"] is not None and m["ci"] and m["ci"][1] is not None
                          else f"{bid} not yet (too few load-bound requests)" for bid, m in measured.items()) + ".")
    est, rep = report["index_cached_tokens_estimated"], report["index_cached_tokens_reported"]
    if rep:
        console.print(f"Prefix index: estimated {est:,.0f} cached tokens where backends reported {rep:,.0f} "
                      f"({est / rep:.0%}).")
    share, predictions = report.get("index_within_one_block_share"), report.get("index_predictions", {})
    if share is not None:
        console.print(f"Prefix index: predicted K within one block of the reported cached tokens on {share:.1%} of "
                      f"{sum(predictions.values())} answers (over: {predictions['over']}, under: "
                      f"{predictions['under']}); {report.get('index_resets', 0)} index resets.")
    for example in report["error_examples"]:
        console.print(f"[red]error:[/red] {example}")
    console.print(
        "Columns: κ_crit_lin = the backend's κ_crit_linear (κ_M·κ_HW, host link, T-independent); transfer = its "
        "requests the gateway routed transfer-bound (x-kappa-regime: κ_ratio_loaded above the request's own κ_crit "
        "there); κ = κ_ratio, K/T over every cached token; κ_load = κ_ratio_loaded, K_loaded/T over the host-tier "
        "and KV-pool tokens; κ_crit p50 = the median of its requests' x-kappa-crit (at their T, over the link "
        "their loads crossed); T≥y = the largest 10% of prefills (new tokens); hit = cached / prompt tokens as the "
        "backends reported; TTFT p50/p90 in modelled seconds; kJ = the backend's energy over the run (idle "
        "included).\n"
        "Next: run it yourself — `kappa-gateway mock-fleet` and `kappa-gateway serve` (config/fleet.local.yaml), "
        "then point any OpenAI client at http://127.0.0.1:8000/v1; watch GET /v1/kappa/backends, "
        "POST /v1/kappa/route (explain a decision) and /metrics; replay a real trace with "
        "`kappa-gateway replay ../shared/data/traces/mooncake/conversation_trace.jsonl --url http://127.0.0.1:8000`.")
