"""The health blip of `bench/faults.py` (issue 28): every backend fails its health check once while load runs.

Every mock backend is SIGSTOPped for ``BLIP_S`` (2.4 s) at a moment a stream is in flight, then
SIGCONTed. That is just over the gateway's health-check timeout (2 s,
``gateway.backends.backend_set.PROBE_TIMEOUT_S``), so one round of checks fails on every
backend, and well under ``unhealthy_threshold`` rounds (3 × 0.5 s plus their timeouts) and the
idle timeout (5 s): no backend should leave rotation and no request should be cut. Requests in
flight wait out the pause and complete; the report's ``clear_error``, ``truncated`` and
``hung`` counts are the requests cut (0 expected).

Like the rest of the bench this imports none of the project's packages: only the bench's own
processes are signalled, by pid (`faults_fleet.Children`).
"""

from __future__ import annotations

import signal
from typing import Any

from faults_load import Window

BLIP_S = 2.4


async def health_blip(run: Any, w: Window) -> Window:
    """Pause every mock backend for BLIP_S with a stream in flight (``run`` is `faults.Run`)."""
    backends = [f"b{i}" for i in range(run.fleet.n_backends)]
    w.notes["streams_at_t0"] = await run.load.wait_stream(None)
    w.t0 = run.clock()
    for name in backends:
        run.fleet.children.signal(name, signal.SIGSTOP)
    try:
        await run._hold(w, BLIP_S)
    finally:
        for name in backends:
            run.fleet.children.signal(name, signal.SIGCONT)
    return await run._post(w)
