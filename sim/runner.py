"""Run several policies over one trace and fleet: prepare once, simulate each, in parallel.

The trace's gateway-side hashes (`sim.prompts.prepare_trace`) depend on the trace and the
fleet's index settings only, so they are computed once and shared by every policy's run.
The runs are independent (each its own engines, index, ledger and policy object), so with
``workers`` > 1 they go to forked worker processes, which inherit the prepared trace
without copying or pickling it; results come back in the order of ``policies``. Where
``fork`` is unavailable the runs are sequential. The results do not depend on ``workers``.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Mapping, Sequence
from typing import Any

from router.policies import build_policy
from sim.fleet import Fleet
from sim.prompts import PreparedRequest, prepare_trace
from sim.simulator import SimResult, simulate
from sim.traces import TraceRequest

# Set in the parent just before forking; the workers read it (fork copies it, no pickling).
_SHARED: tuple[Fleet, Sequence[PreparedRequest], int] | None = None


def scale_rate(requests: Sequence[TraceRequest], rate_scale: float) -> list[TraceRequest]:
    """The same trace with arrivals ``rate_scale`` times as frequent (times divided by it).

    Raises:
        ValueError: ``rate_scale`` ≤ 0.
    """
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    if rate_scale == 1:
        return list(requests)
    return [dataclasses.replace(r, arrival_s=r.arrival_s / rate_scale) for r in requests]


def _run_one(job: tuple[str, Mapping[str, Any]]) -> SimResult:
    assert _SHARED is not None
    fleet, prepared, seed = _SHARED
    name, params = job
    return simulate(fleet, build_policy(name, params), prepared, seed=seed)


def run_policies(requests: Sequence[TraceRequest], fleet: Fleet, policies: Sequence[str], *, seed: int = 0,
                 params: Mapping[str, Mapping[str, Any]] | None = None,
                 workers: int | None = None) -> dict[str, SimResult]:
    """Simulate ``requests`` on ``fleet`` under each policy.

    Args:
        requests: the trace (length/hash-id records).
        fleet: the fleet; requests ask for its first served model.
        policies: policy names (`router.policies.POLICY_NAMES`), no repeats.
        seed: the tie-break seed, the same for every policy.
        params: per-policy parameters by name (default: each policy's defaults).
        workers: processes to use; ``None`` = min(policies, CPUs), 1 = in this process.

    Returns:
        ``{policy name: SimResult}`` in the order of ``policies``.

    Raises:
        router.policies.PolicyConfigError: an unknown policy or a bad parameter (checked
            before anything runs).
        ValueError: repeated policy names, or records the simulator cannot take.
    """
    global _SHARED
    if len(set(policies)) != len(policies):
        raise ValueError(f"policies repeat: {list(policies)}")
    params = params or {}
    jobs = [(name, dict(params.get(name, {}))) for name in policies]
    for name, p in jobs:
        build_policy(name, p)  # fail before simulating anything
    model = fleet.served_models()[0]
    prepared = prepare_trace(requests, model=model, block_size_bytes=fleet.block_size_bytes)
    workers = min(len(jobs), os.cpu_count() or 1) if workers is None else workers
    _SHARED = (fleet, prepared, seed)
    try:
        if workers <= 1 or len(jobs) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
            results = [_run_one(job) for job in jobs]
        else:
            with multiprocessing.get_context("fork").Pool(min(workers, len(jobs))) as pool:
                results = pool.map(_run_one, jobs, chunksize=1)
    finally:
        _SHARED = None
    return {name: result for (name, _), result in zip(jobs, results, strict=True)}
