"""Fault injection under load: what clients see when a backend, Redis or the gateway fails (issues 12, 16).

    python bench/faults.py [--quick] [--json] [--out FILE] [--legacy-config] [--faults a,b,...]
                           [--time-scale S] [--tree DIR] [--logdir DIR] [--pd]

``--pd`` (issue 26): a P/D fleet (two prefill mocks, two decode mocks, an interconnect), long fresh
prompts the gateway splits, and faults on each phase instead of those below (`faults_pd.py`).

Starts, as its own children on 127.0.0.1 (ended by pid when it ends, also on Ctrl-C or
SIGTERM; anything stopped gets SIGCONT first), a ``redis-server`` (``--save "" --appendonly
no``), four mock vLLM backends (``python -m gateway mock-vllm``, llama-3.1-8b on h100-sxm,
``--time-scale 0.2``, each its own process) and the gateway (``python -m gateway serve``)
with the Redis index (50 ms timeout), health checks every 0.5 s and the timeouts of
`gateway_section`: idle 5 s, drain delay 1 s, graceful shutdown 5 s, base ejection time 5 s,
retries as the spec's default, first byte 30 s (above the client cap, so a request stuck
before its first byte shows as hung rather than rescued by an arbitrary short deadline),
and the index's circuit breaker at its defaults (when the tree has one). A fifth backend,
``probe``, is an upstream stub (`upstream_stub.py`) serving only the model ``probe``: the
probe client's (`faults_probe.py`) latency through the gateway is what the gateway adds.
``--legacy-config`` leaves out the keys issue 12 adds (`NEW_GATEWAY_KEYS`), which a
gateway older than issue 12 rejects; the default writes them. ``--tree DIR`` runs ``python -m
gateway`` from another source tree (e.g. ``git archive <commit> | tar -x -C DIR``).

Load runs through the gateway all along: 8 closed-loop aiohttp workers, half streamed
(``stream_options.include_usage``), chat bodies on four shared system prompts of 300–4,000
tokens plus a fresh user turn, max_tokens 32–128, 50 ms between a worker's requests.
Then the faults, one after another, each in its own window: ``pre_s`` of untouched load
(the baseline), the injection at t0, the fault held, then ``post_s`` more load
(``--quick``: 3 s and 12 s; full: 10 s and 20 s):

1. ``backend_kill9``: SIGKILL the backend that answered most requests in the pre-fault
   phase, at a moment it has a stream in flight (waiting up to 3 s for one). It is
   restarted on its port after the window; every fault starts once the gateway reports
   all four backends healthy and Redis answers.
2. ``backend_sigstop``: SIGSTOP the busiest backend (chosen likewise) for 60 s (quick: 10 s), then SIGCONT.
3. ``redis_kill9``: SIGKILL Redis, restart it on the same port 10 s later (quick: 3 s).
4. ``redis_sigstop``: SIGSTOP Redis for 10 s (quick: 5 s), then SIGCONT. (Issue 16 measures
   the gateway's added p50 latency here: ``probe`` below.)
   ``upgrade_flood`` (issue 28): Upgrade requests up to the connection cap; `faults_upgrade.py`.
   ``health_blip`` (`faults_blip.py`): every backend SIGSTOPped for 2.4 s, one failed round
   of health checks, fewer than the ejection threshold: 0 requests cut expected.
5. ``gateway_sigterm``: SIGTERM the gateway with a stream in flight. The load then probes
   ``/ready`` as a load balancer would, every 0.5 s (half the drain delay; the first probe
   0.5 s after the signal), and stops sending once it is not 200 (a refused connection
   counts as not ready). The window ends when the gateway has exited (SIGKILL after
   drain + graceful + 5 s) and the load has stopped, so requests refused before the probe
   noticed count. The run ends there: this fault always goes last, the gateway is not restarted.

Every request in flight at t0 or sent before the window closes is put in exactly one class:

- **ok**: HTTP 200 and, non-streamed, a JSON object with ``choices``; streamed, the body
  ends with ``data: [DONE]`` and holds no ``data: {"error": ...}`` event.
- **clear_error**: a 4xx/5xx whose body is an OpenAI-shaped ``{"error": {...}}``; or a 200
  stream holding an error event and ending with ``data: [DONE]`` or with that error event.
- **truncated**: anything else that ended: a stream ending with neither [DONE] nor an
  error event, a non-OpenAI body, a refused, reset or closed connection (``refused``
  counts the connections refused among them).
- **hung**: not finished after the idle timeout + 5 s (10 s, the client's cap on a whole
  request; it gives up then, so the bench always ends).

**recovery_s** is measured from the injection (t0) for every fault, stopped processes
included (``resumed_s``/``restarted_s`` say when SIGCONT or the restart came). The window
after t0 is cut into 1-s bins (the last takes the remainder); a bin is *bad* if any
request sent in it did not end ok, or if fewer requests completed ok in it than 80% of
the pre-fault ok rate. recovery_s is the end of the last bad bin: 0 if none was bad, null
if the window's last bin was still bad, or for ``gateway_sigterm`` (nothing to recover
to). ``post_s`` ≥ 12 s, so a request hung at t0 meets the cap inside the window.

Per fault, besides the five required keys: ``streamed`` (the same counts for streamed
requests only), ``pre_ok_per_s``, ``ok_per_bin`` (ok completions per 1-s bin from t0),
``probe`` (`faults_probe.probe_report`: the added p50 latency of the index path per 250 ms
window from 2 s before t0, its median per phase, and ``p50_back_s`` — from t0 until the
added p50 stays within 2 ms for the rest of the fault —, also a top-level key),
``in_flight_at_t0``, ``streams_in_flight_at_t0``, ``refused``, ``unclean_end`` (ok or
clear_error streams whose HTTP body was cut instead of terminated), ``first_failure_s``
and ``last_failure_s`` (send times of non-ok requests from t0), ``ok_latency_p50_s`` and
``ok_latency_max_s``, ``index_errors`` and ``retries`` (growth of
``gateway_index_errors_total`` and ``gateway_upstream_retries_total`` over the fault;
null once the gateway is gone), the victim and its pid, and for ``gateway_sigterm``
``exit_code``, ``exit_s`` and ``load_stopped_s``.

The JSON (``--json`` on stdout, ``--out FILE``) is ``{"faults": {name: {...}}, "config":
{...}, "duration_s", "command"}``; without ``--json`` a table goes to stdout. Progress goes
to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
from faults_blip import health_blip
from faults_fleet import Fleet, redis_pings
from faults_load import Bodies, Load, Window, busiest_backend, summarize, table
from faults_pd import (PD_FAULTS, PD_INTERCONNECT, PdBodies, client_disconnect_prefill, decode_kill9, decode_sigstop,
                       link_fail, link_slow, pd_backends, pd_mock_args, prefill_kill9, prefill_sigstop, split_share)
from faults_probe import PROBE_MODEL, PROBE_THINK_S, Probe, probe_report
from faults_upgrade import flood_gateway_keys, upgrade_flood

import hot_path

hot_path.select()  # this script is an entry point: compiled or source, before the project is imported

from prefix_index.redis_defaults import DEFAULT_TIMEOUT_S as INDEX_TIMEOUT_S  # the gateway's default

ROOT = Path(__file__).resolve().parent.parent
MODEL, HARDWARE, N_BACKENDS = "llama-3.1-8b", "h100-sxm", 4
WORKERS, THINK_S = 8, 0.05
IDLE_TIMEOUT_S, DRAIN_DELAY_S, GRACEFUL_S, FIRST_BYTE_TIMEOUT_S = 5.0, 1.0, 5.0, 30.0
# How often the load polls /ready after the SIGTERM, as a load balancer's readiness probe
# would (half the drain delay; Kubernetes' default probe period is 10 s).
READY_POLL_S = 0.5
CAP_S = IDLE_TIMEOUT_S + 5.0
# Keys issue 12 adds to the gateway: section; --legacy-config leaves them out.
NEW_GATEWAY_KEYS = ("upstream_per_try_timeout_s", "shutdown_drain_delay_s", "retry")
FAULTS = ("backend_kill9", "backend_sigstop", "redis_kill9", "redis_sigstop", "health_blip", "upgrade_flood",
          "gateway_sigterm")


@dataclass(frozen=True)
class Timing:
    pre_s: float  # untouched load before each injection (the baseline)
    post_s: float  # load after the fault is cleared (≥ CAP_S + 2)
    backend_stop_s: float
    redis_down_s: float
    redis_stop_s: float


FULL, QUICK = Timing(10, 20, 60, 10, 10), Timing(3, 12, 10, 3, 5)


def gateway_section(port: int, legacy: bool) -> dict:
    """The config's gateway: section. ``legacy`` omits NEW_GATEWAY_KEYS (today's gateway rejects them)."""
    section = {
        "host": "127.0.0.1", "port": port, "health_interval_s": 0.5, "scrape_interval_s": 1.0,
        "upstream_connect_timeout_s": 1.0,
        # Above the client cap: a request stuck before its first byte shows as hung, not rescued by a
        # retry after an arbitrary short deadline (real deployments keep this long: prefills queue).
        "upstream_first_byte_timeout_s": FIRST_BYTE_TIMEOUT_S,
        "upstream_idle_timeout_s": IDLE_TIMEOUT_S,
        "graceful_shutdown_timeout_s": GRACEFUL_S,
        "upstream_per_try_timeout_s": None,
        "shutdown_drain_delay_s": DRAIN_DELAY_S,
        "retry": {"retry_on": ["connect-failure", "reset", "5xx"], "max_retries": 1, "max_body_bytes": 4194304},
    }
    section.update({} if legacy else flood_gateway_keys())  # upgrade_flood: faults_upgrade.py
    return {k: v for k, v in section.items() if not (legacy and k in NEW_GATEWAY_KEYS)}


def gateway_config(port: int, backend_ports: list[int], redis_url: str, legacy: bool, stub_port: int,
                   pd: bool = False) -> dict:
    """The gateway's config: the mocks serve MODEL, the probe's stub alone serves PROBE_MODEL; ``pd``:
    the P/D fleet's roles and interconnect (`faults_pd`), which the mocks also read."""
    mocks = pd_backends(backend_ports) if pd else [
        {"id": f"b{i}", "url": f"http://127.0.0.1:{p}", "model": MODEL, "hardware": HARDWARE}
        for i, p in enumerate(backend_ports)]
    return {"gateway": gateway_section(port, legacy),
            "index": {"backend": "redis", "redis_url": redis_url, "key_prefix": "faults", "timeout_s": INDEX_TIMEOUT_S,
                      "block_size_tokens": 64, "bytes_per_token": 4.0},
            "routing": {"policy": "kappa", "seed": 0},
            **({} if legacy else {"outlier_detection": {"base_ejection_time_s": 5.0}}),
            "models": {PROBE_MODEL: {"profile": MODEL}},
            **({"interconnect": PD_INTERCONNECT} if pd else {}),
            "backends": mocks + [{"id": "probe", "url": f"http://127.0.0.1:{stub_port}", "model": PROBE_MODEL, "hardware": HARDWARE}]}


BACKEND_KILLS = ("backend_kill9", "prefill_kill9", "decode_kill9")  # redis_kill9 restarts Redis itself


class Run:
    """The faults in order, on one fleet under one continuous load."""

    def __init__(self, args: argparse.Namespace, fleet: Fleet) -> None:
        self.args, self.fleet, self.t = args, fleet, args.timing
        self.started = time.monotonic()
        bodies = PdBodies(MODEL, seed=0) if args.pd else Bodies(MODEL, seed=0)
        self.load = Load(fleet.url + "/v1/chat/completions", bodies, WORKERS, THINK_S, CAP_S, self.clock, seed=0)
        self.probe = Probe(fleet.url + "/v1/chat/completions", self.clock)
        self.windows: list[Window] = []
        self.counters: dict[str, tuple] = {}

    def clock(self) -> float:
        return time.monotonic() - self.started

    upgrade_flood = upgrade_flood  # faults_upgrade.py
    prefill_kill9, prefill_sigstop, decode_kill9, decode_sigstop = prefill_kill9, prefill_sigstop, decode_kill9, \
        decode_sigstop  # faults_pd.py, as the next three
    link_fail, link_slow, client_disconnect_prefill = link_fail, link_slow, client_disconnect_prefill

    async def run(self) -> list[dict]:
        self.load.start()
        self.probe.start()
        finished = False
        try:
            for name in self.args.faults:
                await self.fleet.wait_whole()
                before = await self.fleet.counters()
                pre_start = self.clock()
                await asyncio.sleep(self.t.pre_s)  # the pre-fault phase: load only
                w = await getattr(self, name)(Window(name, pre_start, 0.0, 0.0))
                self.counters[name] = (before, await self.fleet.counters())
                self.windows.append(w)
                print(f"[{self.clock():6.1f}s] {name} done", file=sys.stderr, flush=True)
                if w.name in BACKEND_KILLS:  # restart after the window: the next fault sees the whole fleet
                    self.fleet.start_backend(w.notes["victim"])
            finished = True
        finally:
            await self.probe.stop()
            await self.load.stop(abort=not finished)  # on an error or Ctrl-C, do not wait out the cap
        return [self._result(w) for w in self.windows]

    def _result(self, w: Window) -> dict:
        out = summarize(self.load.records, w)
        before, after = self.counters[w.name]
        for key in ("index_errors", "retries", *(("splits", "prefill_fallbacks") if self.args.pd else ())):
            out[key] = None if before is None or after is None else after[key] - before[key]
        if self.args.pd:
            out["split_share"] = split_share(self.load.records, w)
        if w.name != "gateway_sigterm":  # nothing to come back to after it
            lifted = w.notes.get("resumed_s", w.notes.get("restarted_s"))
            out["probe"] = probe_report(self.probe.samples, w.pre_start, w.t0,
                                        None if lifted is None else w.t0 + lifted, w.end)
            out["p50_back_s"] = out["probe"].get("p50_back_s")
        return {**out, **w.notes}

    async def _victim(self, w: Window) -> str:
        """The busiest backend of the pre-fault phase, once it has a stream in flight (or after 3 s)."""
        victim = busiest_backend(self.load.records, w.pre_start) or "b0"
        streams = await self.load.wait_stream(victim)
        w.notes.update(victim=victim, victim_pid=self.fleet.children.procs[victim].pid, victim_streams_at_t0=streams)
        return victim

    async def _hold(self, w: Window, seconds: float, note: str = "resumed_s") -> None:
        await asyncio.sleep(seconds)  # the fault stays injected this long
        w.notes[note] = round(self.clock() - w.t0, 2)

    async def _post(self, w: Window) -> Window:
        await asyncio.sleep(self.t.post_s)
        w.end = self.clock()
        return w

    health_blip = health_blip  # bench/faults_blip.py

    async def backend_kill9(self, w: Window) -> Window:
        victim = await self._victim(w)
        w.t0 = self.clock()
        self.fleet.children.signal(victim, signal.SIGKILL)
        return await self._post(w)

    async def backend_sigstop(self, w: Window) -> Window:
        victim = await self._victim(w)
        w.t0 = self.clock()
        self.fleet.children.signal(victim, signal.SIGSTOP)
        await self._hold(w, self.t.backend_stop_s)
        self.fleet.children.signal(victim, signal.SIGCONT)
        return await self._post(w)

    async def redis_kill9(self, w: Window) -> Window:
        w.t0 = self.clock()
        self.fleet.children.signal("redis", signal.SIGKILL)
        await self._hold(w, self.t.redis_down_s, "restarted_s")
        self.fleet.start_redis()
        await self.fleet.wait_process("redis", lambda: redis_pings(self.fleet.redis_port))
        return await self._post(w)

    async def redis_sigstop(self, w: Window) -> Window:
        w.t0 = self.clock()
        self.fleet.children.signal("redis", signal.SIGSTOP)
        await self._hold(w, self.t.redis_stop_s)
        self.fleet.children.signal("redis", signal.SIGCONT)
        return await self._post(w)

    async def gateway_sigterm(self, w: Window) -> Window:
        proc = self.fleet.children.procs["gateway"]
        w.recovery = False
        if not await self.fleet.get_ok(self.fleet.url + "/ready"):
            raise RuntimeError("the gateway is not ready before its SIGTERM")
        watcher = asyncio.create_task(self._stop_load_when_not_ready(w))  # its next probe: READY_POLL_S on
        w.notes["streams_at_sigterm"] = await self.load.wait_stream(None)
        w.t0 = self.clock()
        self.fleet.children.signal("gateway", signal.SIGTERM)
        deadline = time.monotonic() + DRAIN_DELAY_S + GRACEFUL_S + 5.0
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # polling the process's exit
        exit_s = self.clock() - w.t0
        if proc.poll() is None:
            self.fleet.children.signal("gateway", signal.SIGKILL)
            w.notes["killed_after_s"] = round(exit_s, 2)
        w.notes.update(exit_code=proc.returncode, exit_s=round(exit_s, 2))
        await watcher  # its next probe finds the listener gone, if it has not stopped the load already
        w.end = self.clock()  # the window: until the gateway is gone and the load has stopped sending
        return w

    async def _stop_load_when_not_ready(self, w: Window) -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                         timeout=aiohttp.ClientTimeout(total=1.0)) as http:
            while True:
                await asyncio.sleep(READY_POLL_S)  # a load balancer's readiness probe period
                try:
                    async with http.get(self.fleet.url + "/ready") as resp:
                        ready = resp.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ready = False
                if not ready:
                    self.load.close_gate()
                    w.notes["load_stopped_s"] = round(self.clock() - w.t0, 3)
                    return


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short holds and windows (~2 min)")
    p.add_argument("--json", action="store_true", help="print the JSON on stdout instead of the table")
    p.add_argument("--out", type=Path, help="also write the JSON to this file")
    p.add_argument("--legacy-config", action="store_true",
                   help=f"omit the keys today's gateway does not know ({', '.join(NEW_GATEWAY_KEYS)})")
    p.add_argument("--faults", help="comma list, run in this order (gateway_sigterm always last; default: all "
                   "of the mode's)")
    p.add_argument("--pd", action="store_true", help="a P/D fleet and faults on each phase (faults_pd.py): "
                   + ", ".join(PD_FAULTS))
    p.add_argument("--time-scale", type=float, default=0.2, help="the mocks' wall seconds per modelled second")
    p.add_argument("--tree", type=Path, default=ROOT, help="source tree whose `python -m gateway` runs the mocks "
                   "and the gateway (default: this one), e.g. a `git archive` export of a commit")
    p.add_argument("--logdir", type=Path, help="keep the children's logs here (default: a temporary directory)")
    args = p.parse_args(argv)
    known = PD_FAULTS if args.pd else FAULTS
    faults = [f for f in (args.faults or ",".join(known)).split(",") if f]
    unknown = sorted(set(faults) - set(known))
    if unknown:
        p.error(f"unknown faults {unknown}; known{' with --pd' * args.pd}: {', '.join(known)}")
    args.faults = [f for f in faults if f != "gateway_sigterm"] + (["gateway_sigterm"] * ("gateway_sigterm" in faults))
    args.timing = QUICK if args.quick else FULL
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        workdir = args.logdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kappa-faults-")))
        workdir.mkdir(parents=True, exist_ok=True)
        mock_args = pd_mock_args(str(workdir / "gateway.yaml"), args.time_scale) if args.pd else [
            "--model", MODEL, "--hardware", HARDWARE, "--time-scale", str(args.time_scale), "--log-level", "warning"]
        fleet = Fleet(workdir, args.tree, lambda port, ports, redis_url, stub_port: gateway_config(
            port, ports, redis_url, args.legacy_config, stub_port, args.pd), n_backends=N_BACKENDS, mock_args=mock_args)
        stack.callback(fleet.children.end_all)  # also on Ctrl-C / SIGTERM: SIGCONT, then end each child by pid
        results = asyncio.run(_main(args, fleet))
    report = {"faults": dict(zip(args.faults, results, strict=True)),
              "config": {"tree": str(args.tree), "legacy_config": args.legacy_config, "quick": args.quick, "pd": args.pd,
                         **({"backends": fleet.config["backends"], "interconnect": PD_INTERCONNECT} if args.pd else {}),
                         "gateway": fleet.config["gateway"], "index_timeout_s": INDEX_TIMEOUT_S,
                         "mock_time_scale": args.time_scale, "workers": WORKERS, "think_s": THINK_S,
                         "client_cap_s": CAP_S, "ready_probe_s": READY_POLL_S, "probe_think_s": PROBE_THINK_S,
                         "timing": asdict(args.timing)},
              "duration_s": round(time.monotonic() - began, 1), "command": shlex.join(sys.orig_argv)}
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text if args.json else table(report))


async def _main(args: argparse.Namespace, fleet: Fleet) -> list[dict]:
    task = asyncio.current_task()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)  # finally blocks still run
    try:
        await fleet.start()
        print(f"fleet up: gateway {fleet.url}, logs in {fleet.workdir}", file=sys.stderr, flush=True)
        return await Run(args, fleet).run()
    finally:
        if fleet.http is not None:
            await fleet.http.close()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the children were ended in main's finally
        sys.exit(130)
    except asyncio.CancelledError:  # our SIGTERM handler cancelled the run
        sys.exit(143)
