"""Robust least squares through the origin, for the κ_crit fit (`router.kappa_fit`).

Iteratively reweighted least squares in two stages: Huber's weights (Huber 1964; k = 1.345),
which bound an outlier's pull but never drop a row, from ordinary least squares; then Tukey's
biweight (Beaton & Tukey 1974; c = 4.685), which drops outliers, from the Huber solution — a
redescending estimator needs a robust start (Maronna, Martin & Yohai, *Robust Statistics*,
2006, §4.4). Both tuning constants give 95% efficiency under normal errors; the scale is the
median absolute residual × 1.4826, floored at the caller's ``min_scale``. Small systems only
(a few coefficients, a few hundred rows): plain Python, no I/O (the router imports no
numerical library).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

HUBER_K = 1.345  # Huber's tuning constant, robust standard deviations (95% efficiency)
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


def robust_least_squares(rows: list[list[float]], ys: list[float], *, min_scale: float = 0.0,
                         prior_weights: list[float] | None = None) -> RobustFit | None:
    """Least squares through the origin of ys on rows, made robust in two stages (IRLS).

    Huber weights first, from the ordinary least-squares solution: they never reach zero, so a
    few gross outliers among the few rows that carry a coefficient cannot take all of them out
    at once (a biweight started from OLS can: one slowed row among five pulls OLS far enough
    that the other four fall outside the biweight's limit and the system turns singular). Then
    Tukey's biweight from the Huber solution, which gives the outliers no weight at all.

    Args:
        rows: one list of p regressors per observation (p ≥ 1, the same for every row).
        ys: the observations, as many as rows.
        min_scale: the least residual scale the weights use, in the unit of ``ys`` (≥ 0): the
            data's own resolution, so that residuals below it are never taken for outliers
            however well the other rows fit.
        prior_weights: a weight in (0, 1] per row that multiplies the robust one (an older
            observation counting less, `router.kappa_fit`); None: all 1. The returned ``weights``
            are the products.

    Returns the coefficients, their covariance (residual variance × (XᵀWX)⁻¹), the final
    weights and the residuals' robust scale (not floored); None when the system is singular
    or fewer rows than coefficients carry weight.
    """
    prior = prior_weights or [1.0] * len(rows)
    fit = _irls(rows, ys, prior, _huber_weights, min_scale, prior)
    if fit is None:
        return None
    return _irls(rows, ys, fit.weights, _biweight_weights, min_scale, prior)


def _huber_weights(residuals: list[float], scale: float) -> list[float]:
    limit = HUBER_K * scale
    return [1.0 if abs(r) <= limit else limit / abs(r) for r in residuals]


def _biweight_weights(residuals: list[float], scale: float) -> list[float]:
    limit = TUKEY_C * scale
    return [(1 - (r / limit) ** 2) ** 2 if abs(r) < limit else 0.0 for r in residuals]


def _irls(rows: list[list[float]], ys: list[float], weights: list[float],
          weigh: Callable[[list[float], float], list[float]], min_scale: float,
          prior: list[float]) -> RobustFit | None:
    """Reweighted least squares from ``weights`` with ``weigh`` (residuals, scale → weights)."""
    p = len(rows[0])
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
        scale = max(MAD_TO_SD * sorted(abs(r) for r in residuals)[len(residuals) // 2], min_scale)
        if scale <= 1e-12 * max(abs(y) for y in ys):  # (nearly) exact data: every row fits
            weights = list(prior)
        else:
            weights = [p * w for p, w in zip(prior, weigh(residuals, scale), strict=True)]
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
