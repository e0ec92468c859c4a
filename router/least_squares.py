"""Robust least squares through the origin, for the κ_crit fit (`router.kappa_fit`).

Iteratively reweighted least squares with Tukey's biweight (Beaton & Tukey 1974; c = 4.685
robust standard deviations gives 95% efficiency under normal errors; the scale is the median
absolute residual × 1.4826). Small systems only (a few coefficients, a few hundred rows):
plain Python, no I/O (the router imports no numerical library).
"""

from __future__ import annotations

from dataclasses import dataclass

TUKEY_C = 4.685  # biweight tuning constant, in robust standard deviations (95% efficiency)
MAD_TO_SD = 1.4826  # median absolute deviation → standard deviation, for normal errors
IRLS_ROUNDS = 20


@dataclass(frozen=True, slots=True)
class RobustFit:
    """Coefficients, their covariance (residual variance × (XᵀWX)⁻¹), the final weights in [0, 1]
    and the robust residual scale (1.4826 × median |residual|)."""

    beta: list[float]
    cov: list[list[float]]
    weights: list[float]
    scale: float


def robust_least_squares(rows: list[list[float]], ys: list[float]) -> RobustFit | None:
    """Least squares through the origin of ys on rows, Tukey-biweight reweighted (IRLS).

    Returns the coefficients, their covariance (residual variance × (XᵀWX)⁻¹) and the final
    weights; None when the system is singular or fewer rows than coefficients carry weight.
    """
    p = len(rows[0])
    weights = [1.0] * len(rows)
    beta: list[float] | None = None
    inverse: list[list[float]] | None = None
    for _ in range(IRLS_ROUNDS):
        xtx = [[sum(w * row[a] * row[b] for w, row in zip(weights, rows, strict=True)) for b in range(p)]
               for a in range(p)]
        xty = [sum(w * row[a] * y for w, row, y in zip(weights, rows, ys, strict=True)) for a in range(p)]
        inverse = invert(xtx)
        if inverse is None:
            return None
        new_beta = [sum(inverse[a][b] * xty[b] for b in range(p)) for a in range(p)]
        residuals = [y - sum(b * x for b, x in zip(new_beta, row, strict=True))
                     for row, y in zip(rows, ys, strict=True)]
        scale = MAD_TO_SD * sorted(abs(r) for r in residuals)[len(residuals) // 2]
        if scale <= 1e-12 * max(abs(y) for y in ys):  # (nearly) exact data: every row fits
            weights = [1.0] * len(rows)
        else:
            limit = TUKEY_C * scale
            weights = [(1 - (r / limit) ** 2) ** 2 if abs(r) < limit else 0.0 for r in residuals]
        converged = beta is not None and all(abs(a - b) <= 1e-9 * max(abs(a), 1e-12) for a, b in zip(new_beta, beta))
        beta = new_beta
        if converged:
            break
    assert beta is not None and inverse is not None
    residuals = [y - sum(b * x for b, x in zip(beta, row, strict=True)) for row, y in zip(rows, ys, strict=True)]
    dof = sum(weights) - p
    if dof <= 0:
        return None
    variance = sum(w * r * r for w, r in zip(weights, residuals, strict=True)) / dof
    scale = MAD_TO_SD * sorted(abs(r) for r in residuals)[len(residuals) // 2]
    return RobustFit(beta, [[variance * x for x in row] for row in inverse], weights, scale)


def invert(matrix: list[list[float]]) -> list[list[float]] | None:
    """Gauss–Jordan inverse of a small square matrix, or None when it is singular."""
    n = len(matrix)
    m = [row[:] + [1.0 if i == j else 0.0 for j in range(n)] for i, row in enumerate(matrix)]
    scale = max((abs(x) for row in matrix for x in row), default=0.0)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-12 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        lead = m[col][col]
        m[col] = [x / lead for x in m[col]]
        for r in range(n):
            if r != col and m[r][col]:
                factor = m[r][col]
                m[r] = [x - factor * y for x, y in zip(m[r], m[col], strict=True)]
    return [row[n:] for row in m]
