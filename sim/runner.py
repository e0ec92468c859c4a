"""Run several policies (fleets, loads) over one trace: prepare once, simulate each, in parallel.

The trace's gateway-side hashes (`sim.prompts.prepare_trace`) depend on the trace and the
fleet's index settings only (model, index block bytes), so they are computed once per such
setting and shared by every run; a rate scale only divides the arrival times. The runs are
independent (each its own engines, index, ledger and policy object), so with ``workers`` >
1 they go to forked worker processes, which inherit the prepared trace without copying or
pickling it; results come back in the order of the jobs. Where ``fork`` is unavailable the
runs are sequential. The results do not depend on ``workers``.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.policies import build_policy
from sim.fleet import Fleet
from sim.prompts import PreparedRequest, prepare_trace
from sim.replicas import Topology
from sim.simulator import SimResult, simulate
from sim.traces import TraceRequest


@dataclass(frozen=True, slots=True)
class SimJob:
    """One run of `run_jobs`: a fleet (by its key), a policy, a load.

    Args:
        fleet: key into the ``fleets`` mapping given to `run_jobs`.
        policy: a policy name (`router.policies.POLICY_NAMES`).
        rate_scale: arrivals this many times as frequent (> 0).
        params: the policy's parameters (default: its defaults).
        topology: gateway replicas and what they share (default: one gateway).
        client_concurrency: most requests in flight client-side (`sim.simulator.Simulator`; None: no limit).
    """

    fleet: str
    policy: str
    rate_scale: float = 1.0
    params: Mapping[str, Any] = field(default_factory=dict)
    topology: Topology = Topology()
    client_concurrency: int | None = None


# Set in the parent just before forking; the workers read it (fork copies it, no pickling).
_SHARED: tuple[Mapping[str, Fleet], Mapping[tuple[str, int], Sequence[PreparedRequest]], Sequence[SimJob], int] | None
_SHARED = None


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


def _prepare_key(fleet: Fleet) -> tuple[str, int]:
    return fleet.served_models()[0], fleet.block_size_bytes


def _run_one(position: int) -> SimResult:
    assert _SHARED is not None
    fleets, prepared, jobs, seed = _SHARED
    job = jobs[position]
    fleet = fleets[job.fleet]
    trace = prepared[_prepare_key(fleet)]
    if job.rate_scale != 1:
        trace = [dataclasses.replace(p, arrival_s=p.arrival_s / job.rate_scale) for p in trace]
    return simulate(fleet, build_policy(job.policy, job.params), trace, seed=seed, topology=job.topology,
                    client_concurrency=job.client_concurrency)


def run_jobs(requests: Sequence[TraceRequest], fleets: Mapping[str, Fleet], jobs: Sequence[SimJob], *,
             seed: int = 0, workers: int | None = None) -> list[SimResult]:
    """Simulate ``requests`` once per job (fleet × policy × rate scale), in parallel.

    Args:
        requests: the trace (length/hash-id records), at rate scale 1.
        fleets: the fleets by key; requests ask for each fleet's first served model.
        jobs: the runs; each names a key of ``fleets``.
        seed: the tie-break seed, the same for every run.
        workers: processes to use; ``None`` = min(jobs, CPUs), 1 = in this process.

    Returns:
        One `SimResult` per job, in the order of ``jobs``.

    Raises:
        router.policies.PolicyConfigError: an unknown policy or a bad parameter (checked
            before anything runs).
        ValueError: an unknown fleet key, a rate scale ≤ 0, or records the simulator cannot take.
    """
    global _SHARED
    for job in jobs:
        if job.fleet not in fleets:
            raise ValueError(f"job names unknown fleet {job.fleet!r} (known: {', '.join(fleets)})")
        if job.rate_scale <= 0:
            raise ValueError(f"rate_scale must be > 0, got {job.rate_scale}")
        build_policy(job.policy, job.params)  # fail before simulating anything
    prepared = {}
    for fleet in fleets.values():
        key = _prepare_key(fleet)
        if key not in prepared:
            prepared[key] = prepare_trace(requests, model=key[0], block_size_bytes=key[1])
    workers = min(len(jobs), os.cpu_count() or 1) if workers is None else workers
    _SHARED = (fleets, prepared, jobs, seed)
    try:
        if workers <= 1 or len(jobs) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
            return [_run_one(i) for i in range(len(jobs))]
        with multiprocessing.get_context("fork").Pool(min(workers, len(jobs))) as pool:
            return pool.map(_run_one, range(len(jobs)), chunksize=1)
    finally:
        _SHARED = None


def run_policies(requests: Sequence[TraceRequest], fleet: Fleet, policies: Sequence[str], *, seed: int = 0,
                 params: Mapping[str, Mapping[str, Any]] | None = None,
                 workers: int | None = None, topology: Topology = Topology(),
                 client_concurrency: int | None = None) -> dict[str, SimResult]:
    """Simulate ``requests`` on ``fleet`` under each policy.

    Args:
        requests: the trace (length/hash-id records).
        fleet: the fleet; requests ask for its first served model.
        policies: policy names (`router.policies.POLICY_NAMES`), no repeats.
        seed: the tie-break seed, the same for every policy.
        params: per-policy parameters by name (default: each policy's defaults).
        workers: processes to use; ``None`` = min(policies, CPUs), 1 = in this process.
        topology: gateway replicas and what they share (`sim.replicas.Topology`).
        client_concurrency: most requests in flight client-side (None: no limit; `sim.simulator.Simulator`).

    Returns:
        ``{policy name: SimResult}`` in the order of ``policies``.

    Raises:
        router.policies.PolicyConfigError: an unknown policy or a bad parameter (checked
            before anything runs).
        ValueError: repeated policy names, or records the simulator cannot take.
    """
    if len(set(policies)) != len(policies):
        raise ValueError(f"policies repeat: {list(policies)}")
    params = params or {}
    jobs = [SimJob("fleet", name, 1.0, dict(params.get(name, {})), topology, client_concurrency) for name in policies]
    results = run_jobs(requests, {"fleet": fleet}, jobs, seed=seed, workers=workers)
    return {job.policy: result for job, result in zip(jobs, results, strict=True)}
