"""The demo's human-readable report: a rich table per backend for the κ run, κ beside the baseline,
notes that reconcile the shares, the run-to-run tolerance, and a legend.

Every column and share is printed with its one definition, `gateway.commands.demo_figures.DEFINITIONS`
(the JSON's ``definitions``), so the legend cannot drift from the figures.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from gateway.commands.demo_figures import DEFINITIONS, SELF_CONSISTENCY

IDLE = "idle"  # a backend that served no request: no per-request figure (DEFINITIONS["idle"])
LEGEND_KEYS = ("kappa_crit_linear", "transfer_share", "kappa_ratio", "kappa_ratio_loaded", "kappa_crit_p50", "never",
               "large_t_share", "prefix_hit_ratio", "ttft", "e2e", "itl", "energy_per_request_j", "idle",
               "high_kappa_share")
"""The definitions the legend prints, in order (the comparison table adds ``kappa_vs_baseline``; the
measured κ_crit's line carries its own, `SELF_CONSISTENCY`)."""
PD_LEGEND_KEYS = ("kv_role", "split_share", "splits_per_pair", "prefix_hit_ratio_pd", "kv_transferred_tokens")
"""A P/D fleet's further definitions (its table adds the kv_role and prefills columns)."""
TABLE_WIDTH = 196  # 16 columns, the hardware one wide
PD_TABLE_WIDTH = 216  # and a P/D fleet's two more


def _f(value: float | None, fmt: str, scale: float = 1.0) -> str:
    return "–" if value is None else format(value * scale, fmt)


def _crit_p50(b: dict[str, Any]) -> str:
    if b["kappa_crit_p50"] is None and b["kappa_crit_never_requests"]:
        return "never"  # the median request cannot be transfer-bound there (x-kappa-crit: inf)
    return _f(b["kappa_crit_p50"], ".1f")


def _backend_row(b: dict[str, Any], pd: bool) -> list[str]:
    head = [b["id"], b["hardware"], *((b["kv_role"], str(b["prefills"])) if pd else ()), f"{b['kappa_crit_linear']:.1f}",
            str(b["requests"])]
    if b["requests"] == 0:
        return head + [IDLE] * 12
    energy = _f(b["energy_per_request_j"], ",.0f")
    return head + [
        f"{b['regimes']['transfer']} ({_f(b['transfer_share'], '.0%')})",
        _f(b["kappa_ratio_p50"], ".2f"), _f(b["kappa_ratio_p90"], ".1f"), _f(b["kappa_ratio_loaded_p90"], ".1f"),
        _crit_p50(b), str(b["large_t_requests"]), _f(b["prefix_hit_ratio"], ".0%"), _f(b["ttft_p50_s"], ".3f"),
        _f(b["ttft_p90_s"], ".3f"), _f(b["e2e_p90_s"], ".2f"), _f(b["itl_p50_s"], ".1f", 1e3), energy]


def _backend_table(report: dict[str, Any]) -> Table:
    title = (f"kappa-gateway demo: {report['requests']} requests, {report['errors']} errors, policy "
             f"{report['policy']}, {report['wall_s']} s of wall time")
    table = Table(title=title, caption=report["workload"])
    large_t = f"T≥{report['large_t_threshold_tokens'] / 1e3:.1f}k"
    pd = report.get("pd") is not None
    for col in ("backend", "hardware", *(("kv_role", "prefills") if pd else ()), "κ_crit_lin", "reqs", "transfer", "κ p50", "κ p90", "κ_load p90", "κ_crit p50",
                large_t, "hit", "TTFT p50", "TTFT p90", "E2E p90", "ITL p50 ms", "J/req"):
        table.add_column(col, justify="left" if col in ("backend", "hardware", "kv_role") else "right", no_wrap=True)
    for b in report["backends"]:
        table.add_row(*_backend_row(b, pd))
    return table


COMPARED = (("TTFT p50 (s)", "ttft_p50_s", ".3f", 1.0, "ttft_p50"), ("TTFT p90 (s)", "ttft_p90_s", ".3f", 1.0, "ttft_p90"),
            ("E2E p90 (s)", "e2e_p90_s", ".2f", 1.0, "e2e_p90"), ("ITL p50 (ms)", "itl_p50_s", ".1f", 1e3, "itl_p50"),
            ("hit ratio", "prefix_hit_ratio", ".1%", 1.0, "prefix_hit_ratio"),
            ("transfer share", "transfer_share", ".1%", 1.0, "transfer_share"),
            ("J/request", "energy_per_request_j", ",.0f", 1.0, "energy_per_request"))
"""The comparison table's rows: label, `run_figures` key, format, scale, `kappa_vs_baseline` key."""


def _comparison_table(report: dict[str, Any]) -> Table:
    base = report["baseline"]
    mine, theirs, ratios = report["figures"], base["figures"], report["kappa_vs_baseline"]
    table = Table(title=f"{report['policy']} beside {base['policy']}: the same {report['requests']} requests, "
                        f"each run on a fresh fleet ({report['wall_s']} s and {base['wall_s']} s of wall time)")
    for col in ("figure", report["policy"], base["policy"], f"{report['policy']}/{base['policy']}"):
        table.add_column(col, justify="left" if col == "figure" else "right", no_wrap=True)
    for label, key, fmt, scale, ratio in COMPARED:
        table.add_row(label, _f(mine[key], fmt, scale), _f(theirs[key], fmt, scale), _f(ratios[ratio], ".2f"))
    if report.get("pd") is not None and base.get("pd") is not None:
        table.add_row("split share", _f(report["pd"]["split_share"], ".1%"), _f(base["pd"]["split_share"], ".1%"), "")
        table.add_row("KV transferred (tokens)", _f(mine.get("kv_transferred_tokens"), ",.0f"),
                      _f(theirs.get("kv_transferred_tokens"), ",.0f"), "")
    table.add_row("errors", str(mine["errors"]), str(theirs["errors"]), "")

    def split(figures: dict[str, Any]) -> str:
        return " / ".join(str(n) for n in figures["backend_requests"].values())

    table.add_row("requests per backend", split(mine), split(theirs), "")
    table.add_row("  (" + " / ".join(mine["backend_requests"]) + ")", "", "", "")
    return table


AGGREGATED_ONLY = ("This repeat tolerance was measured on the aggregated fleet (config/fleet.local.yaml), not "
                   "on this P/D one: here it is a guide, not a measured bound. ")
"""Said before the tolerance on a P/D fleet (`bench/demo_repeat.py` ran the aggregated demo only)."""


def tolerance_line(tolerance: dict[str, float], pd: bool = False) -> str:
    """The repeat tolerance in words, and the bands of κ/baseline ratios it makes noise; on a P/D fleet
    (``pd``) prefixed by `AGGREGATED_ONLY`."""
    def band(relative: float) -> str:
        return f"{1 / (1 + relative):.2f}–{1 + relative:.2f}"

    latency = max(tolerance["ttft_p90_relative"], tolerance["e2e_p90_relative"])
    size = (f"{tolerance['min_requests']:g} requests or more" if tolerance["max_requests"] is None
            else f"{tolerance['min_requests']:g}–{tolerance['max_requests']:g} requests")
    return ((AGGREGATED_ONLY if pd else "") + f"Run-to-run noise ({size}): two runs of one policy with one seed, each on a fresh fleet, serve each "
            f"backend within "
            f"{tolerance['backend_share']:.0%} of the requests + {tolerance['backend_slack_requests']:g}, with TTFT p90 "
            f"within {tolerance['ttft_p90_relative']:.0%} (the larger over the smaller), E2E p90 within "
            f"{tolerance['e2e_p90_relative']:.0%} and J/request within {tolerance['energy_per_request_relative']:.0%} "
            f"(repeat_tolerance, measured: live timing, the mocks step "
            f"on the wall clock). So a κ/baseline ratio of TTFT p90 or E2E p90 in {band(latency)}, or of J/request in "
            f"{band(tolerance['energy_per_request_relative'])}, is noise, not a difference; TTFT p50 and ITL spread "
            f"more and are not bounded.")


def _reconciliation(report: dict[str, Any]) -> str:
    """Per backend, its high-κ requests beside its transfer-bound ones: the two shares reconciled."""
    parts = []
    for b in report["backends"]:
        if b["requests"] == 0:
            parts.append(f"{b['id']} prefilled {b['prefills']}, decoded none" if b["prefills"] else f"{b['id']} {IDLE}")
            continue
        n, high, transfer = b["requests"], b["high_kappa_requests"], b["regimes"]["transfer"]
        parts.append(f"{b['id']} {high} of {n} high-κ ({high / n:.0%}), {transfer} transfer-bound ({transfer / n:.0%}; "
                     f"{b['high_kappa_transfer_requests']} of them high-κ)")
    return (f"High-κ (κ_ratio > {report['high_kappa_threshold']:.1f}) beside transfer-bound, per backend: "
            + "; ".join(parts) + ". A high-κ request that is not transfer-bound read its K in place from HBM, or its "
            "own κ_crit there is higher than its κ_ratio_loaded.")


def pd_line(pd: dict[str, Any]) -> str:
    """A P/D run's splits in words (`gateway.commands.demo_figures.pd_figures`)."""
    counted = pd["splits_counted_by_gateway"]
    pairs = ", ".join(f"{x['prefill_backend']} → {x['decode_backend']} {x['splits']}" for x in pd["pairs"]) or "none"
    return (f"P/D: {pd['splits']} requests split, split share {_f(pd['split_share'], '.1%')}"
            + (f" (the gateway counted {counted:g} in gateway_pd_splits_total)" if counted is not None else "")
            + f"; {pd['prefill_fallbacks']} prefill fallbacks to aggregated. Splits per (prefill → decode): {pairs}.")


def _role_placement(role: str, g: dict[str, Any]) -> str:
    """One role's placement: its shares, and the split requests it prefilled (a prefill-only role: those alone)."""
    prefills = g.get("prefills", 0)
    if not g["requests"]:
        return f"{role} prefilled {prefills} split requests (decoded elsewhere)" if prefills else f"{role} {IDLE}"
    shares = f"{role} {_f(g['high_kappa_share'], '.0%')} / {_f(g['large_t_share'], '.0%')}"
    return shares + (f" (and prefilled {prefills} split requests)" if prefills else "")


def _notes(report: dict[str, Any], console: Console) -> None:
    if report.get("pd") is not None:
        console.print(pd_line(report["pd"]))
    roles = report.get("placement_by_role", {})
    if roles:
        console.print("Placement by role — high-κ share / large-T share of each role's requests: " + "; ".join(
            _role_placement(role, g) for role, g in roles.items()) + ".")
        console.print(_reconciliation(report))
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
                          else f"{bid} not yet (too few load-bound requests)" for bid, m in measured.items())
                      + ". " + SELF_CONSISTENCY)
    est, rep = report["index_cached_tokens_estimated"], report["index_cached_tokens_reported"]
    if rep:
        console.print(f"Prefix index: estimated {est:,.0f} cached tokens where backends reported {rep:,.0f} "
                      f"({est / rep:.0%}).")
    share, predictions = report.get("index_within_one_block_share"), report.get("index_predictions", {})
    if share is not None:
        modes = report.get("index_modes") or {}
        exact = sum(mode == "exact" for mode in modes.values())
        kind = f"exact, from the engines' KV events, on {exact} of {len(modes)} backends" if exact else "approximate"
        console.print(f"Prefix index ({kind}): predicted K within one block of the reported cached tokens on {share:.1%} of "
                      f"{sum(predictions.values())} answers (over: {predictions['over']}, under: "
                      f"{predictions['under']}); {report.get('index_resets', 0)} index resets.")
    for run in (report, report.get("baseline") or {}):
        for example in run.get("error_examples", ()):
            console.print(f"[red]error ({run['policy']}):[/red] {example}")


def print_report(report: dict[str, Any], console: Console) -> None:
    """Print `gateway.commands.demo.run_demo`'s dict (or one run's, `build_report`'s, with ``wall_s``
    and ``workload``) for a person."""
    width = TABLE_WIDTH if report.get("pd") is None else PD_TABLE_WIDTH
    if console.width < width:  # a narrow terminal: wider lines wrap, the table's columns keep their figures
        console = Console(width=width, file=console.file)
    console.print(_backend_table(report))
    _notes(report, console)
    keys = list(LEGEND_KEYS) + (list(PD_LEGEND_KEYS) if report.get("pd") is not None else [])
    if report.get("baseline"):
        console.print(_comparison_table(report))
        keys.append("kappa_vs_baseline")
    if report.get("repeat_tolerance"):
        console.print(tolerance_line(report["repeat_tolerance"], pd=report.get("pd") is not None))
    console.print("Legend (the JSON's definitions):\n" + "\n".join(f"  {DEFINITIONS[key]}" for key in keys))
    config = report.get("config", "config/fleet.local.yaml")
    console.print(
        f"Next: run it yourself — `kappa-gateway mock-fleet --config {config}` and `kappa-gateway serve --config "
        f"{config}`, "
        "then point any OpenAI client at http://127.0.0.1:8000/v1; watch GET /v1/kappa/backends, "
        "POST /v1/kappa/route (explain a decision) and /metrics; replay a real trace with "
        "`kappa-gateway replay ../shared/data/traces/mooncake/conversation_trace.jsonl --url http://127.0.0.1:8000`.")
