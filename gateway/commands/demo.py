"""``kappa-gateway demo``: the fleet of ``config/fleet.local.yaml``, the gateway, real traffic, a report,
and the same traffic through a baseline policy beside it.

Each run starts the four mock backends (child processes) and the gateway (a child process,
embedded index) on free loopback ports, replays a workload through real HTTP
(`gateway.commands.replay`) and collects its figures (`gateway.commands.demo_figures`, every
term defined once in its ``DEFINITIONS``): per backend, requests, the transfer share, κ_ratio and
κ_ratio_loaded p50/p90, the requests' median κ_crit, prefix hit rate, TTFT p50/p90, E2E p90, ITL
p50 and energy (each mock's ``mock_vllm:energy_joules_total``), and the κ_crit the gateway
measured with its 95% interval (``/v1/kappa/backends``, `router.kappa_fit`).

First the config's policy (κ), then the baseline (``round-robin`` unless told otherwise; any of
`router.policies.POLICY_NAMES`, or none): the same requests (one seed: the same arrivals and
prompts, and the gateway's tie-breaks unless the config seeds them), on a fresh fleet and gateway (cold caches, new ports), one run after the other, never
both at once. `gateway.commands.demo_compare` puts the two side by side (``kappa_vs_baseline``)
and states how far two runs of one policy differ by live timing alone (``repeat_tolerance``).
Every process a run started is ended by its pid when the run finishes.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from fleet_config.catalog import CONFIG_DIR, default_catalog
from gateway.commands.fleet import READY_TIMEOUT_S, mock_fleet
from gateway.commands.demo_compare import kappa_vs_baseline, repeat_tolerance
from gateway.commands.demo_figures import DEFINITIONS, build_report
from gateway.commands.demo_pd import since
from gateway.commands.processes import answers_ok, free_port, stop_processes
from gateway.commands.replay import replay
from fleet_config.settings import Settings, load_settings, parse_settings
from router.policies import POLICY_NAMES
from sim.traces import TraceRequest, load_trace
from sim.workloads import mooncake_like

DEFAULT_CONFIG = CONFIG_DIR / "fleet.local.yaml"
DEFAULT_REQUESTS = 400
DEFAULT_RATE_RPS = 2.5  # modelled requests/s (Mooncake's own rate is 3.4)
# Mocks run 2.5× faster than real time: 400 requests in about a minute of wall time, enough for
# per-backend shares to mean something, with the 2-core machine's mocks still on schedule.
DEFAULT_TIME_SCALE = 0.4
DEFAULT_BASELINE = "round-robin"  # the policy a router without κ or a cache index would run


def on_free_ports(settings: Settings, *, policy: str | None = None, routing_seed: int | None = None) -> Settings:
    """The same fleet with the gateway and every backend moved to free loopback ports (and no
    shutdown drain: no load balancer watches the demo's gateway): a backend's URL and its
    ``kv_events`` endpoint and replay endpoint (issue 30), so two fleets never share a port.

    Args:
        policy: a `router.policies.POLICY_NAMES` name to route by instead of the config's; a
            policy other than the config's runs with its own default parameters (the config's
            ``routing.params`` are the config policy's). None keeps the config's.
        routing_seed: seeds the gateway's tie-breaks (``routing.seed``) when the config sets none:
            then two runs break an exact tie (two identical, cold backends) the same way.

    Raises:
        ConfigError: an unknown policy (the message lists the known ones).
    """
    doc = settings.model_dump(mode="json")
    if policy is not None and policy != doc["routing"]["policy"]:
        doc["routing"]["policy"], doc["routing"]["params"] = policy, {}
    if routing_seed is not None and doc["routing"]["seed"] is None:
        doc["routing"]["seed"] = routing_seed
    doc["gateway"]["host"], doc["gateway"]["port"] = "127.0.0.1", free_port()
    doc["gateway"]["shutdown_drain_delay_s"] = 0.0
    for backend in doc["backends"]:
        backend["url"] = f"http://127.0.0.1:{free_port()}"
        events = backend.get("kv_events")
        if events:  # the mock binds these: the config's fixed 5557… would clash with any other fleet
            events["endpoint"] = f"tcp://127.0.0.1:{free_port()}"
            if events.get("replay_endpoint"):
                events["replay_endpoint"] = f"tcp://127.0.0.1:{free_port()}"
    return parse_settings(doc, default_catalog(), env={})


@contextmanager
def gateway_process(settings: Settings) -> Iterator[str]:
    """``kappa-gateway serve`` for ``settings`` as a child process; yields its URL once ready."""
    url = f"http://127.0.0.1:{settings.gateway.port}"
    env = {k: v for k, v in os.environ.items() if k != "KAPPA_REDIS_URL"}  # the demo uses the embedded index
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(settings.model_dump(mode="json"), f)
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", f.name, "--log-level", "warning"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not answers_ok(f"{url}/ready"):
            if proc.poll() is not None:
                raise RuntimeError(f"the gateway exited: {proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway was not ready in time")
            time.sleep(0.05)  # poll interval
        yield url
    finally:
        stop_processes([proc], timeout_s=15)
        proc.stderr.close()
        Path(f.name).unlink(missing_ok=True)


def scrape_metrics(url: str) -> dict[str, float]:
    """Sample name → summed value from a /metrics page (empty if unreachable); also
    ``name{label="value"}`` → the sum over the samples carrying that one label value."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5.0) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
            for key in (f'{s.name}{{{label}="{value}"}}' for label, value in s.labels.items()):
                out[key] = out.get(key, 0.0) + s.value
    return out


def _measured_kappa_crit(url: str) -> dict[str, dict[str, Any]]:
    """Backend id → the gateway's measured κ_crit (``kappa_crit_linear_measured``, its ``_ci`` and the
    load-bound requests behind it) from ``/v1/kappa/backends``; empty if unreachable."""
    try:
        with urllib.request.urlopen(f"{url}/v1/kappa/backends", timeout=5.0) as resp:
            backends = json.load(resp)["backends"]
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return {}
    return {b["id"]: {"value": b.get("kappa_crit_linear_measured"), "ci": b.get("kappa_crit_linear_measured_ci"),
                      "load_requests": (b.get("kappa_fit") or {}).get("requests", {}).get("load", 0),
                      "index_mode": (b.get("kv_events") or {}).get("mode", "approximate")}
            for b in backends}


RUN_OVERHEAD_S = 15.0  # wall seconds a run spends starting its fleet and gateway and draining its last requests


def wall_estimate_s(requests: int, rate_rps: float, speedup: float, time_scale: float, runs: int) -> float:
    """Roughly how long ``runs`` runs of the built-in generator's ``requests`` take on the wall clock, s:
    the arrivals' span (modelled, sped up, times the time scale) plus `RUN_OVERHEAD_S`, per run."""
    return runs * (RUN_OVERHEAD_S + requests / rate_rps * time_scale / speedup)


def workload(requests: int, trace: Path | None, rate_rps: float, seed: int) -> list[TraceRequest]:
    if trace is not None:
        return load_trace(trace, limit=requests)
    return mooncake_like(requests, rate_rps=rate_rps, seed=seed, max_input_tokens=48_000, max_output_tokens=1_024)


def run_demo(*, requests: int = DEFAULT_REQUESTS, trace: Path | None = None, rate_rps: float = DEFAULT_RATE_RPS,
             speedup: float = 1.0, time_scale: float = DEFAULT_TIME_SCALE, seed: int = 0,
             config: Path = DEFAULT_CONFIG, baseline: str | None = DEFAULT_BASELINE,
             progress: bool = True) -> dict[str, Any]:
    """Run the whole demo: the config's policy, then ``baseline`` on the same requests.

    Arrivals are in modelled time: ``rate_rps`` and a trace's timestamps, sped up by ``speedup``,
    are replayed ``1 / time_scale`` times faster on the wall clock, as the mocks run.

    Args:
        baseline: a `router.policies.POLICY_NAMES` name, or None for the config's policy alone.

    Returns:
        The config policy's run (`run_policy`) with ``workload``, ``config`` (its path), ``definitions``
        (`gateway.commands.demo_figures.DEFINITIONS`), ``repeat_tolerance``
        (`gateway.commands.demo_compare.repeat_tolerance` for this many requests), ``baseline`` (the baseline's run, the
        same keys and figures; null without one), ``kappa_vs_baseline``
        (`gateway.commands.demo_compare.kappa_vs_baseline`; null without one) and ``total_wall_s``
        (both runs, s; ``wall_s`` is the config policy's run alone).

    Raises:
        ValueError: an unknown ``baseline`` policy.
    """
    if baseline is not None and baseline not in POLICY_NAMES:
        raise ValueError(f"unknown baseline policy {baseline!r} (known: {', '.join(POLICY_NAMES)})")
    started = time.monotonic()
    settings = load_settings(config, default_catalog(), env={})
    reqs = workload(requests, trace, rate_rps, seed)
    report = run_policy(on_free_ports(settings, routing_seed=seed), reqs, speedup=speedup, time_scale=time_scale,
                        progress=progress)
    other = None
    if baseline is not None:  # ports chosen now: the first run's are free again, and it is over
        other = run_policy(on_free_ports(settings, policy=baseline, routing_seed=seed), reqs, speedup=speedup,
                           time_scale=time_scale, progress=progress)
    report.update(
        workload=str(trace) if trace else f"built-in Mooncake-like generator, {rate_rps:g} req/s, seed {seed}",
        config=str(config), definitions=DEFINITIONS, repeat_tolerance=repeat_tolerance(len(reqs)).as_dict(), baseline=other,
        kappa_vs_baseline=kappa_vs_baseline(report["figures"], other["figures"]) if other else None,
        total_wall_s=round(time.monotonic() - started, 1))
    return report


def run_policy(settings: Settings, reqs: Sequence[TraceRequest], *, speedup: float, time_scale: float,
               progress: bool) -> dict[str, Any]:
    """One run: a fresh mock fleet and gateway for ``settings`` (already on free ports), ``reqs``
    replayed through them, then everything stopped.

    Returns:
        `gateway.commands.demo_figures.build_report` of the run, with ``kappa_crit_measured``
        (backend id → the gateway's measured κ_crit, `_measured_kappa_crit`) and ``wall_s`` (this run's).
    """
    started = time.monotonic()
    with mock_fleet(settings, time_scale=time_scale), gateway_process(settings) as url:
        before = {b.id: scrape_metrics(b.url) for b in settings.backends}
        results = asyncio.run(replay(reqs, url=url, model=settings.served_models()[0], speedup=speedup / time_scale,
                                     concurrency=512, progress=progress))
        backend_metrics = {b.id: since(scrape_metrics(b.url), before[b.id]) for b in settings.backends}
        gateway_metrics = scrape_metrics(url)
        measured = _measured_kappa_crit(url)
    report = build_report(settings, results, backend_metrics, gateway_metrics, time_scale)
    report["index_modes"] = {b: m.pop("index_mode") for b, m in measured.items()}  # exact: fed by KV events
    report["kappa_crit_measured"] = measured
    report["wall_s"] = round(time.monotonic() - started, 1)
    return report
