"""``kappa-gateway crit --backend … --measured SOURCE``: each backend's measured figures beside its profile's.

SOURCE is a running gateway's base URL (its ``GET /v1/kappa/backends``) or a saved copy of that
answer (a gateway whose admin routes need a key: save it with the key, then pass the file). The
figures are the gateway's measured factors (``kappa_fit.factors``, `router.link_factors`: measured
over profiled seconds of compute, host link, KV-pool link, HBM), as measured — not the blend the
router routes on — applied to the backend's spec from the config (`router.link_factors.measured_spec`).
A factor without evidence stays at the profile's, and the row says which ones were measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from router.link_factors import FACTORS, FactorEstimate, LinkFactorEstimates, LinkFactors, deviations

FETCH_TIMEOUT_S = 5.0


def load_measured(source: str) -> dict[str, dict[str, Any]]:
    """Backend id → its ``/v1/kappa/backends`` entry, from a gateway URL or a saved answer.

    Raises:
        ValueError: unreachable, not JSON, or not a ``/v1/kappa/backends`` answer (the message says which).
    """
    try:
        if source.startswith(("http://", "https://")):
            resp = httpx.get(source.rstrip("/") + "/v1/kappa/backends", timeout=FETCH_TIMEOUT_S)
            resp.raise_for_status()
            doc = resp.json()
        else:
            doc = json.loads(Path(source).read_text(encoding="utf-8"))
    except (httpx.HTTPError, OSError, ValueError) as exc:
        raise ValueError(f"cannot read measured figures from {source}: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("backends"), list):
        raise ValueError(f"{source} is not a /v1/kappa/backends answer (no 'backends' list)")
    return {b["id"]: b for b in doc["backends"] if isinstance(b, dict) and "id" in b}


def estimates(backend: dict[str, Any]) -> LinkFactorEstimates:
    """The measured factors of one ``/v1/kappa/backends`` entry (None where it says ``evidence: none``)."""
    factors = ((backend.get("kappa_fit") or {}).get("factors") or {})
    out: list[FactorEstimate | None] = []
    for name in FACTORS:
        f = factors.get(name) or {}
        ratio, ci = f.get("time_ratio"), f.get("ci") or [None, None]
        if not isinstance(ratio, (int, float)) or ratio <= 0:
            out.append(None)
            continue
        low = ci[0] if isinstance(ci[0], (int, float)) else ratio
        high = ci[1] if isinstance(ci[1], (int, float)) else float("inf")
        out.append(FactorEstimate(float(ratio), float(low), float(high), int(f.get("requests") or 0),
                                  float(f.get("evidence_requests") or 0.0)))
    return LinkFactorEstimates(*out)


def as_measured(found: LinkFactorEstimates) -> LinkFactors:
    """The measured factors as they are (1 where not measured)."""
    return LinkFactors(*(1.0 if e is None else e.time_ratio for e in found))


def deviation_lines(backend_id: str, found: LinkFactorEstimates, ratio: float) -> list[str]:
    """One line per factor measured beyond ``ratio`` of its profile (its whole 95% interval)."""
    return [f"{backend_id}: its {name} takes {value:.3g}× the time its profile says (measured, beyond {ratio:g}×): "
            "compute κ_crit from measured sustained figures, not the datasheet's"
            for name, value in deviations(found, ratio).items()]
