"""The table `bench/index_accuracy.py` prints: one column per mode, the median of its runs and their
min–max (`index_accuracy_report.summarise_modes`)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

# (label, figure, scale, format)
ROWS = (
    ("within 16 tokens (engine block)", "within_16_share", 100.0, ".2f%"),
    ("within 64 tokens (index block)", "within_64_share", 100.0, ".2f%"),
    ("gateway's own counter (index block)", "gateway_within_index_block_share", 100.0, ".2f%"),
    ("MAE, tokens", "mae_tokens", 1.0, ".1f"),
    ("over-credited (> 16 / > 64)", ("over_16", "over_64"), 1.0, ".0f"),
    ("under-credited (> 16 / > 64)", ("under_16", "under_64"), 1.0, ".0f"),
    ("routed with the backend exact", "exact_routed", 1.0, ".0f"),
    ("TTFT p50, s", "ttft_p50_s", 1.0, ".2f"),
    ("TTFT p90, s", "ttft_p90_s", 1.0, ".2f"),
    ("E2E p90, s", "e2e_p90_s", 1.0, ".2f"),
    ("prefix hit ratio", "prefix_hit_ratio", 1.0, ".3f"),
    ("errors", "errors", 1.0, ".0f"),
    ("blocks evicted from HBM / host", ("evicted_gpu_blocks", "evicted_cpu_blocks"), 1.0, ".0f"),
    ("CPU s: gateway / mocks", ("gateway_cpu_s", "mocks_cpu_s"), 1.0, ".0f"),
)


def cell(row: dict[str, Any], fig: str, scale: float, fmt: str) -> str:
    """``median (min–max)`` of one figure, or ``–``."""
    value, spread = row.get(fig), row.get(fig + "_range")
    if value is None:
        return "–"
    pct = fmt.endswith("%")
    spec = fmt.rstrip("%")
    unit = "%" if pct else ""
    text = f"{value * scale:{spec}}{unit}"
    if spread and spread[0] != spread[1]:
        text += f" ({spread[0] * scale:{spec}}–{spread[1] * scale:{spec}})"
    return text


def print_table(summary: dict[str, dict[str, Any]]) -> None:
    """Print the summary as a rich table (stdout)."""
    runs = max((row.get("runs", 0) for row in summary.values()), default=0)
    table = Table(title=f"Prefix index accuracy and latency: median (min–max) of {runs} run(s) per mode; modelled s")
    table.add_column("figure")
    for mode in summary:
        table.add_column(mode, justify="right")
    for label, figs, scale, fmt in ROWS:
        figs = figs if isinstance(figs, tuple) else (figs,)
        table.add_row(label, *(" / ".join(cell(row, f, scale, fmt) for f in figs) for row in summary.values()))
    Console().print(table)
