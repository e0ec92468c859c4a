"""The P/D mode of `bench/faults.py` (``--pd``, issue 26): faults on each phase of split requests.

The fleet: four mock backends of llama-3.1-8b, each its own process started from the bench's fleet
config (``python -m gateway mock-vllm --config <it> --backend bN``): ``b0``, ``b1`` on B200 with
``kv_role: prefill``, ``b2``, ``b3`` on H100 with ``kv_role: decode``, an RDMA link of 50 GB/s and
0.5 ms between every pair (`PD_INTERCONNECT`), vLLM's default ``--kv-load-failure-policy fail``
(a failed KV pull answers 500, or a stream's error event) and held KV freed after
``--kv-abort-request-timeout-s`` `ABORT_TIMEOUT_S` modelled seconds (vLLM's 480 s would outlast
the bench). The load's prompts are long and fresh (`PdBodies`: 1,500–4,000 tokens no backend holds),
which the κ policy splits (prefill on a B200, decode on an H100); the report gives the share split.

The faults (each in its own window, as the aggregated ones; `faults.py`'s docstring):

- ``prefill_kill9`` / ``prefill_sigstop``: SIGKILL / SIGSTOP (for ``backend_stop_s``) the prefill
  backend that prefilled most requests before t0, once the gateway has a request in flight there
  (``gateway_in_flight_requests``: a prefill phase, or a decode pulling its KV; up to 3 s). Split requests fall back to aggregated on their decode
  backend; a stopped one leaves rotation after its failed health checks. The killed one is
  restarted after the window.
- ``decode_kill9`` / ``decode_sigstop``: the same on the decode backend that answered most, once a
  stream is in flight on it: its started streams must end with an error event and ``[DONE]``.
- ``link_fail``: every decode mock's reads fail (``POST /kappa/faults/link {"peer": "*", "fail":
  true}``) for ``backend_stop_s``, then ``DELETE``: decode phases answer 500 (a stream: an error
  event), which the gateway retries whole or relays as a clear error.
- ``link_slow``: the same with ``delivered_gb_s`` 1 (a fiftieth of the configured figure).
- ``client_disconnect_prefill``: the load's gate is closed and its requests drain, then
  `DISCONNECTS` clients each send a fresh long prompt and disconnect once the gateway has it in
  flight on a prefill backend (its prefill phase). Notes: ``disconnected_in_prefill``,
  ``running_zero_s`` (from the last disconnect until every mock's ``vllm:num_requests_running``
  and the gateway's ``gateway_in_flight_requests`` are 0; null if not within `ZERO_WITHIN_S`), ``held_after_abort_timeout`` (their request ids still in a prefill mock's
  ``GET /kappa/nixl/meta`` ``held_request_ids`` once the abort timeout has passed: must be 0). The
  gate then reopens; this window's ``sent`` counts the load's requests only.

Per fault, ``split_share`` = requests answered with ``x-kappa-prefill-backend`` over those
answered (the window's), ``splits`` and ``prefill_fallbacks`` the growth of
``gateway_pd_splits_total`` and ``gateway_pd_prefill_fallbacks_total``. Imports none of the
project's packages.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from typing import Any

import aiohttp
from faults_load import Window

PD_MODEL = "llama-3.1-8b"
ROLES = {"b0": ("prefill", "b200"), "b1": ("prefill", "b200"), "b2": ("decode", "h100-sxm"),
         "b3": ("decode", "h100-sxm")}
PREFILL, DECODE = ("b0", "b1"), ("b2", "b3")
PD_INTERCONNECT = {"default": {"bandwidth_gb_s": 50, "latency_s": 0.0005, "kind": "rdma"}}
ABORT_TIMEOUT_S = 20.0  # modelled seconds: 4 s on the wall at the bench's time scale 0.2
PD_FAULTS = ("prefill_kill9", "prefill_sigstop", "decode_kill9", "decode_sigstop", "link_fail", "link_slow",
             "client_disconnect_prefill")
PROMPT_TOKENS = (1500, 4000)
DISCONNECTS = 6
ZERO_WITHIN_S = 5.0
SLOW_GB_S = 1.0


class PdBodies:
    """Fresh long prompts (no shared prefix): what P/D splits. Same interface as `faults_load.Bodies`."""

    def __init__(self, model: str, seed: int) -> None:
        rnd = random.Random(seed)
        self.model = model
        self.vocab = ["".join(rnd.choices("abcdefghijklmnopqrstuvwxyz", k=rnd.randint(2, 7))) for _ in range(4096)]

    def text(self, rnd: random.Random, tokens: int) -> str:
        return " ".join(rnd.choices(self.vocab, k=max(tokens * 4 * 2 // 11, 1)))

    def body(self, rnd: random.Random, stream: bool, max_tokens: int) -> dict[str, Any]:
        content = f"{rnd.getrandbits(64):x} " + self.text(rnd, rnd.randint(*PROMPT_TOKENS))
        body: dict[str, Any] = {"model": self.model, "stream": stream, "max_tokens": max_tokens,
                                "messages": [{"role": "user", "content": content}]}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def make(self, rnd: random.Random, stream: bool) -> bytes:
        return json.dumps(self.body(rnd, stream, rnd.randint(32, 128)), separators=(",", ":")).encode()


def pd_backends(ports: list[int]) -> list[dict[str, Any]]:
    """The fleet's backends (the gateway's and the mocks' config): roles by `ROLES`."""
    return [{"id": f"b{i}", "url": f"http://127.0.0.1:{p}", "model": PD_MODEL, "hardware": ROLES[f"b{i}"][1],
             "kv_role": ROLES[f"b{i}"][0]} for i, p in enumerate(ports)]


def pd_mock_args(config_path: str, time_scale: float) -> Any:
    """``name -> the options of its python -m gateway mock-vllm`` (its port comes from the config)."""
    return lambda name: ["--config", config_path, "--backend", name, "--time-scale", str(time_scale),
                         "--kv-load-failure-policy", "fail", "--kv-abort-request-timeout-s", str(ABORT_TIMEOUT_S),
                         "--log-level", "warning"]


async def mock_metric(http: aiohttp.ClientSession, url: str, name: str) -> float:
    """The sum of ``name``'s samples on a mock's /metrics (0 when absent)."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{", 1)[0].split(" ", 1)[0] == name)


async def in_flight(run: Any, names: tuple[str, ...]) -> float:
    """The gateway's ``gateway_in_flight_requests`` summed over backends ``names`` (a prefill backend's:
    split requests whose prefill phase runs there, or whose decode is pulling its KV)."""
    async with run.fleet.http.get(run.fleet.url + "/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("gateway_in_flight_requests{") and any(f'backend="{n}"' in line for n in names):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def wait_in_flight(run: Any, names: tuple[str, ...], timeout_s: float = 3.0) -> bool:
    """Until the gateway has a request in flight on one of ``names``; False after ``timeout_s``
    (0: look once). The mocks' own ``vllm:num_requests_running`` misses a one-step prefill: the
    engine finishes it at the step's start and the driver then sleeps out the step."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if await in_flight(run, names) > 0:
                return True
        except (aiohttp.ClientError, TimeoutError):
            pass
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.005)  # polling the gateway


def busiest(records: list, since: float, names: tuple[str, ...], attr: str) -> str:
    counts = {n: sum(getattr(r, attr) == n for r in records if r.done >= since) for n in names}
    return max(names, key=lambda n: counts[n])


async def _prefill_victim(run: Any, w: Window) -> str:
    victim = busiest(run.load.records, w.pre_start, PREFILL, "prefill_backend")
    w.notes.update(victim=victim, victim_pid=run.fleet.children.procs[victim].pid,
                   victim_prefill_in_flight=await wait_in_flight(run, (victim,)))
    return victim


async def _decode_victim(run: Any, w: Window) -> str:
    victim = busiest(run.load.records, w.pre_start, DECODE, "backend")
    w.notes.update(victim=victim, victim_pid=run.fleet.children.procs[victim].pid,
                   victim_streams_at_t0=await run.load.wait_stream(victim))
    return victim


async def _kill(run: Any, w: Window, victim: str) -> Window:
    w.t0 = run.clock()
    run.fleet.children.signal(victim, signal.SIGKILL)
    return await run._post(w)  # restarted after the window (`faults.Run.run`)


async def _stop(run: Any, w: Window, victim: str) -> Window:
    w.t0 = run.clock()
    run.fleet.children.signal(victim, signal.SIGSTOP)
    try:
        await run._hold(w, run.t.backend_stop_s)
    finally:
        run.fleet.children.signal(victim, signal.SIGCONT)
    return await run._post(w)


async def prefill_kill9(run: Any, w: Window) -> Window:
    return await _kill(run, w, await _prefill_victim(run, w))


async def prefill_sigstop(run: Any, w: Window) -> Window:
    return await _stop(run, w, await _prefill_victim(run, w))


async def decode_kill9(run: Any, w: Window) -> Window:
    return await _kill(run, w, await _decode_victim(run, w))


async def decode_sigstop(run: Any, w: Window) -> Window:
    return await _stop(run, w, await _decode_victim(run, w))


async def _link(run: Any, w: Window, fault: dict[str, Any]) -> Window:
    urls = [run.fleet.backend_url(d) for d in DECODE]
    w.notes["link_fault"] = fault
    w.t0 = run.clock()
    try:
        for url in urls:
            async with run.fleet.http.post(url + "/kappa/faults/link", json={"peer": "*", **fault}) as resp:
                resp.raise_for_status()
        await run._hold(w, run.t.backend_stop_s)
    finally:
        for url in urls:
            async with run.fleet.http.delete(url + "/kappa/faults/link") as resp:
                resp.raise_for_status()
    return await run._post(w)


async def link_fail(run: Any, w: Window) -> Window:
    return await _link(run, w, {"fail": True})


async def link_slow(run: Any, w: Window) -> Window:
    return await _link(run, w, {"delivered_gb_s": SLOW_GB_S})


async def client_disconnect_prefill(run: Any, w: Window) -> Window:
    """Clients leaving during the prefill phase (module docstring)."""
    run.load.close_gate()
    await run.load.drained()
    w.t0 = run.clock()
    bodies, rnd = PdBodies(PD_MODEL, seed=7), random.Random(7)
    ids, in_prefill = [f"faults-dc-{i}-{rnd.getrandbits(32):x}" for i in range(DISCONNECTS)], 0
    for i, request_id in enumerate(ids):
        body = bodies.body(rnd, stream=i % 2 == 0, max_tokens=64)
        task = asyncio.create_task(run.fleet.http.post(run.fleet.url + "/v1/chat/completions", json=body,
                                                       headers={"x-request-id": request_id},
                                                       timeout=aiohttp.ClientTimeout(total=30)))
        running = await wait_in_flight(run, PREFILL)
        in_prefill += running and not task.done()
        task.cancel()  # the client leaves: aiohttp closes the connection
        await asyncio.gather(task, return_exceptions=True)
    left_s = run.clock()
    zero_s = None
    while run.clock() - left_s < ZERO_WITHIN_S:
        if not await _any_running(run, PREFILL + DECODE) and not await wait_in_flight(run, PREFILL + DECODE, 0.0):
            zero_s = round(run.clock() - left_s, 3)
            break
        await asyncio.sleep(0.02)  # polling the mocks and the gateway
    await asyncio.sleep(max(ABORT_TIMEOUT_S * run.args.time_scale + 1.0 - (run.clock() - left_s), 0))
    held = []
    for name in PREFILL:
        async with run.fleet.http.get(run.fleet.backend_url(name) + "/kappa/nixl/meta") as resp:
            held += [h for h in (await resp.json())["held_request_ids"] if any(i in h for i in ids)]
    w.notes.update(disconnected=len(ids), disconnected_in_prefill=in_prefill, running_zero_s=zero_s,
                   held_after_abort_timeout=len(held))
    run.load.open_gate()
    return await run._post(w)


async def _any_running(run: Any, names: tuple[str, ...]) -> bool:
    """True if any of the mocks ``names`` reports a request running (``vllm:num_requests_running``)."""
    for name in names:
        try:
            if await mock_metric(run.fleet.http, run.fleet.backend_url(name), "vllm:num_requests_running") > 0:
                return True
        except (aiohttp.ClientError, TimeoutError):
            return True  # not known to be idle
    return False


def split_share(records: list, w: Window) -> float | None:
    """Share of the window's answered requests that were split (x-kappa-prefill-backend)."""
    answered = [r for r in records if r.sent < w.end and r.done > w.t0 and r.backend]
    return round(sum(r.prefill_backend is not None for r in answered) / len(answered), 3) if answered else None
