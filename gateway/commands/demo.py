"""``kappa-gateway demo``: the fleet of ``config/fleet.local.yaml``, the gateway, real traffic, a report.

Starts the four mock backends (child processes) and the gateway (a child process, embedded
index) on free loopback ports, replays a workload through real HTTP (`gateway.commands.replay`),
and reports per backend: requests, the transfer-bound share (the regime the gateway decided
for each request against that backend's own κ_crit at the request's T, ``x-kappa-regime``),
κ_ratio and κ_ratio_loaded p50/p90, the requests' median κ_crit, prefix hit rate, TTFT
p50/p90 and energy (from each mock's ``mock_vllm:energy_joules_total``), and the κ_crit the
gateway measured with its 95% interval (``/v1/kappa/backends``, `router.kappa_fit`). Every process it
started is ended by its pid when it finishes.

TTFT is measured by the client on the wall clock and divided by the mocks' time scale, so
it reads in modelled seconds (at time scale 1 the two agree).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
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
from gateway.commands.processes import answers_ok, free_port, stop_processes
from gateway.commands.replay import RequestResult, replay
from sim.report import percentile
from fleet_config.settings import BackendEntry, Settings, load_settings, parse_settings
from router.profiles import Catalog
from sim.traces import TraceRequest, load_trace
from sim.workloads import mooncake_like

DEFAULT_CONFIG = CONFIG_DIR / "fleet.local.yaml"
DEFAULT_REQUESTS = 400
DEFAULT_RATE_RPS = 2.5  # modelled requests/s (Mooncake's own rate is 3.4)
# Mocks run 2.5× faster than real time: 400 requests in about a minute of wall time, enough for
# per-backend shares to mean something, with the 2-core machine's mocks still on schedule.
DEFAULT_TIME_SCALE = 0.4


def on_free_ports(settings: Settings) -> Settings:
    """The same fleet with the gateway and every backend moved to free loopback ports (and no
    shutdown drain: no load balancer watches the demo's gateway)."""
    doc = settings.model_dump(mode="json")
    doc["gateway"]["host"], doc["gateway"]["port"] = "127.0.0.1", free_port()
    doc["gateway"]["shutdown_drain_delay_s"] = 0.0
    for backend in doc["backends"]:
        backend["url"] = f"http://127.0.0.1:{free_port()}"
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
                      "load_requests": (b.get("kappa_fit") or {}).get("requests", {}).get("load", 0)}
            for b in backends}


def workload(requests: int, trace: Path | None, rate_rps: float, seed: int) -> list[TraceRequest]:
    if trace is not None:
        return load_trace(trace, limit=requests)
    return mooncake_like(requests, rate_rps=rate_rps, seed=seed, max_input_tokens=48_000, max_output_tokens=1_024)


def run_demo(*, requests: int = DEFAULT_REQUESTS, trace: Path | None = None, rate_rps: float = DEFAULT_RATE_RPS,
             speedup: float = 1.0, time_scale: float = DEFAULT_TIME_SCALE, seed: int = 0,
             config: Path = DEFAULT_CONFIG, progress: bool = True) -> dict[str, Any]:
    """Run the whole demo; returns the report (see `build_report`).

    Arrivals are in modelled time: ``rate_rps`` and a trace's timestamps, sped up by ``speedup``,
    are replayed ``1 / time_scale`` times faster on the wall clock, as the mocks run.
    """
    settings = on_free_ports(load_settings(config, default_catalog(), env={}))
    reqs = workload(requests, trace, rate_rps, seed)
    started = time.monotonic()
    with mock_fleet(settings, time_scale=time_scale), gateway_process(settings) as url:
        results = asyncio.run(replay(reqs, url=url, model=settings.served_models()[0], speedup=speedup / time_scale,
                                     concurrency=512, progress=progress))
        backend_metrics = {b.id: scrape_metrics(b.url) for b in settings.backends}
        gateway_metrics = scrape_metrics(url)
        measured = _measured_kappa_crit(url)
    report = build_report(settings, results, backend_metrics, gateway_metrics, time_scale)
    report["kappa_crit_measured"] = measured
    report["wall_s"] = round(time.monotonic() - started, 1)
    report["workload"] = str(trace) if trace else f"built-in Mooncake-like generator, {rate_rps:g} req/s, seed {seed}"
    return report


def build_report(settings: Settings, results: Sequence[RequestResult], backend_metrics: dict[str, dict[str, float]],
                 gateway_metrics: dict[str, float], time_scale: float) -> dict[str, Any]:
    """``{"requests", "errors", "backends": [{id, hardware, requests, regimes, kappa_ratio_p50, …}], …}``.

    Per backend, κ names as in `router.kappa`: ``kappa_crit_linear`` (the backend's
    T-independent figure), ``kappa_crit_p50`` (the lower median of its requests' ``x-kappa-crit``;
    null when that median request is never transfer-bound — ``inf``, which JSON lacks — or no
    request has one), ``kappa_crit_never_requests`` (requests whose ``x-kappa-crit`` is ``inf``), ``transfer_share``
    (its requests the gateway labelled ``transfer``: κ_ratio_loaded above their own κ_crit),
    ``kappa_ratio_p50/p90`` and ``kappa_ratio_loaded_p50/p90``. ``high_kappa_requests`` counts
    κ_ratio above ``high_kappa_threshold``, one fleet-wide figure (the lowest κ_crit_linear of
    the compute-dense backends) that classifies the workload for ``placement_by_role``.
    """
    catalog = default_catalog()
    compute_dense = [b for b in settings.backends if b.labels.get("role") == "compute-dense"] or settings.backends
    high_kappa = min(settings.backend_spec(catalog, b).kappa_crit_linear for b in compute_dense)
    ok = [r for r in results if r.error is None]
    large_t = percentile([r.prompt_tokens - r.cached_tokens for r in ok if r.prompt_tokens is not None], 90) or 0
    backends = [_backend_report(settings, catalog, b, [r for r in ok if r.backend == b.id], backend_metrics.get(b.id, {}),
                                time_scale, high_kappa, large_t)
                for b in settings.backends]
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "error_examples": sorted({r.error for r in results if r.error})[:3],
        "high_kappa_threshold": high_kappa, "large_t_threshold_tokens": large_t,
        **_index_report(gateway_metrics),
        "policy": settings.routing.policy, "time_scale": time_scale, "backends": backends,
        "placement_by_role": _placement_by_role(backends),
        "kv_pool_gb": settings.kv_pool.capacity_gb if settings.kv_pool else None,
    }


def _backend_report(settings: Settings, catalog: Catalog, b: BackendEntry, mine: list[RequestResult],
                    metrics: dict[str, float], time_scale: float, high_kappa: float, large_t: float) -> dict[str, Any]:
    """One backend's entry of `build_report`'s ``backends``, from its successful requests ``mine``."""
    kappas = [r.kappa_ratio for r in mine if r.kappa_ratio is not None]
    loaded = [r.kappa_ratio_loaded for r in mine if r.kappa_ratio_loaded is not None]
    crits = [r.kappa_crit for r in mine if r.kappa_crit is not None]
    transfer = sum(r.regime == "transfer" for r in mine)
    crit_p50 = statistics.median_low(crits) if crits else None
    ttfts = [r.ttft_s / time_scale for r in mine if r.ttft_s is not None]
    prompt = sum(r.prompt_tokens or 0 for r in mine)
    cached = sum(r.cached_tokens or 0 for r in mine)
    return {
        "id": b.id, "hardware": f"{b.hardware} x{b.tensor_parallel}"
                                + (f" capped {b.power_cap_w:g} W" if b.power_cap_w else ""),
        "role": b.labels.get("role", ""), "kappa_crit_linear": settings.backend_spec(catalog, b).kappa_crit_linear,
        "requests": len(mine),
        "regimes": {"compute": sum(r.regime == "compute" for r in mine), "transfer": transfer},
        "transfer_share": transfer / len(mine) if mine else None,
        "kappa_ratio_p50": percentile(kappas, 50), "kappa_ratio_p90": percentile(kappas, 90),
        "kappa_ratio_loaded_p50": percentile(loaded, 50), "kappa_ratio_loaded_p90": percentile(loaded, 90),
        "kappa_crit_p50": None if crit_p50 is None or math.isinf(crit_p50) else crit_p50,
        "kappa_crit_never_requests": sum(math.isinf(c) for c in crits),
        "high_kappa_requests": sum(k > high_kappa for k in kappas),
        "large_t_requests": sum((r.prompt_tokens or 0) - (r.cached_tokens or 0) >= large_t for r in mine),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
        "prefix_hit_ratio": cached / prompt if prompt else None,
        "energy_j": metrics.get("mock_vllm:energy_joules_total"),
        "kv_pool_loaded_bytes": metrics.get("mock_vllm:kv_pool_loaded_bytes_total"),
    }


def _placement_by_role(backends: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per role (or backend id without one): its requests, and the shares of them high in κ and large in T."""
    placement: dict[str, dict[str, float]] = {}
    for b in backends:
        group = placement.setdefault(b["role"] or b["id"], {"requests": 0, "high_kappa": 0, "large_t": 0})
        group["requests"] += b["requests"]
        group["high_kappa"] += b["high_kappa_requests"]
        group["large_t"] += b["large_t_requests"]
    for group in placement.values():
        n = max(group["requests"], 1)
        group["high_kappa_share"] = group.pop("high_kappa") / n
        group["large_t_share"] = group.pop("large_t") / n
    return placement


def _index_report(gateway_metrics: dict[str, float]) -> dict[str, Any]:
    """How well the prefix index predicted cached tokens, from the gateway's counters."""
    estimated = gateway_metrics.get("gateway_cached_tokens_estimated_total", 0.0)
    reported = gateway_metrics.get("gateway_cached_tokens_reported_total", 0.0)
    predictions = {outcome: int(gateway_metrics.get(f'gateway_index_predictions_total{{outcome="{outcome}"}}', 0.0))
                   for outcome in ("within_one_block", "over", "under")}
    answered = sum(predictions.values())
    return {
        "index_cached_tokens_estimated": estimated, "index_cached_tokens_reported": reported,
        # answers with usage whose predicted K was within one index block of the reported cached_tokens
        "index_within_one_block_share": predictions["within_one_block"] / answered if answered else None,
        "index_predictions": predictions,
        "index_resets": int(gateway_metrics.get("gateway_index_resets_total", 0.0)),
    }
