"""``serve --workers N``: N gateway processes on one port, each a full replica.

Sockets: The parent binds the port and starts N worker processes (``multiprocessing``'s spawn
context, each passed its listening socket, as uvicorn's own supervisor passes its one). On
Linux each worker has a socket of its own, all bound with ``SO_REUSEPORT``: the kernel spreads
new connections evenly over them (socket(7): "improved load distribution as compared to ...
multiple threads that compete to accept(2) from the same socket"). On one shared socket the
worker that wakes first takes every connection waiting (uvloop accepts until none is left), so
one worker can saturate its core while another idles (BENCHMARKS.md, "`serve --workers 2`").
The port is first bound without ``SO_REUSEPORT`` (and let go), so that a port in use fails the
start rather than joining another server's group. Each socket stays open in the parent: a
replacement worker takes over its predecessor's, and the connections the kernel queued on it
meanwhile wait through its start-up (none is refused), until the parent is told to stop: then
it closes its copies, so the port closes when the workers close theirs at the end of the drain
and new connections are refused, as with one process. The price: a worker whose event loop
hangs keeps getting its share of new connections, which wait (on a shared socket the others
would have taken them) until a load balancer's outlier detection, or the worker's end, ends
that. Elsewhere than Linux, one shared socket.

Each worker is a whole gateway (`gateway.serving.server.GatewayServer`): its own event loop,
backend health checks and ledgers. With a Redis index the workers share the prefix index and
exchange their load (`gateway.replicas.peer_load`) like replicas on separate machines; with
the embedded memory index each worker has an index of its own (``serve`` warns).

Signals: the parent forwards SIGTERM/SIGINT to every worker, which drains on its own
(`gateway.serving.server`: ``/ready`` 503, then the listener closes, then the grace period);
a second signal skips the drains, a third forces the exits. Workers run in their own process
group (a terminal's Ctrl-C reaches them once, through the parent) and get SIGTERM if the
parent dies (Linux ``PR_SET_PDEATHSIG``). A worker that dies while the parent is not stopping
is replaced, unless it died before it ever served (a start-up failure would only repeat: the
parent then stops them all). The parent exits 0 when every worker exited 0 after a stop, else 1.

Metrics: ``/metrics`` on any worker reports the sum over all of them, through
prometheus-client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, a fresh directory the
parent makes and removes; each gauge declares how workers' values combine,
`gateway.telemetry.metrics`). A dead worker's live gauges are dropped (``mark_process_dead``).
In that mode every ``inc``/``set``/``observe`` first asks whether the process forked
(``MmapedValue.__check_for_pid_change`` calls ``os.getpid()``, a system call, each time; its
cost is in BENCHMARKS.md, "`serve --workers 2`"). A worker is spawned, never forks after it
made its metrics, and its pid cannot change, so it reads its pid once, before any metric exists
(`metrics_pid_read_once`), through prometheus-client's own hook for this:
``prometheus_client.values.MultiProcessValue(process_identifier=...)`` (prometheus-client
0.26 ``values.py``; its contract: distinct values in processes running at the same time, which
the pid is). The files stay ``<type>_<pid>.db``, so the parent's ``mark_process_dead(pid)``
and the collector find them. A worker's values are written to those files about once a second,
not at each update (`gateway.telemetry.metric_values`): ``/metrics`` shows the other workers'
values as of at most ~1 s ago, and a worker killed with SIGKILL loses its last second of counts.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from multiprocessing.connection import wait
from multiprocessing.synchronize import Event
from pathlib import Path
from types import FrameType

log = logging.getLogger("kappa_gateway.workers")

PR_SET_PDEATHSIG = 1  # linux/prctl.h
WAIT_POLL_S = 0.5
STOP_MARGIN_S = 5.0  # past a worker's drain + grace + tail margin, before the supervisor kills it


REUSE_PORT = sys.platform == "linux" and hasattr(socket, "SO_REUSEPORT")  # Linux spreads connections over the group


def _listener(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def bind(host: str, port: int, count: int = 1) -> list[socket.socket]:
    """The listening sockets of ``count`` workers on ``host:port`` (uvicorn's backlog: 2048): one
    each with ``SO_REUSEPORT`` on Linux, else one socket for all (``count`` times the same).
    Port 0: the port the first bind got, for all.

    Raises:
        OSError: the port cannot be bound (in use, not a local address, ...).
    """
    plain = _listener(host, port, reuse_port=False)  # fails if anyone holds the port, SO_REUSEPORT or not
    if not REUSE_PORT or count == 1:
        socks = [plain] * count
    else:
        port = plain.getsockname()[1]
        plain.close()
        socks = []
        try:
            for _ in range(count):
                socks.append(_listener(host, port, reuse_port=True))
        except OSError:
            for sock in socks:
                sock.close()
            raise
    for sock in set(socks):
        sock.listen(2048)
        sock.set_inheritable(True)
    return socks


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the parent's forwarded signals still stop the workers


def metrics_pid_read_once() -> None:
    """Make the metrics this process creates from now on name it by the pid it has now, read
    once, instead of calling ``os.getpid()`` at every update, and write their files at
    `gateway.telemetry.metric_values.flush` (module docstring). Only for a process that will not fork,
    called before it creates any metric; a no-op outside prometheus-client's multiprocess mode
    (``PROMETHEUS_MULTIPROC_DIR`` unset)."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        return
    from gateway.telemetry import metric_values

    metric_values.install(os.getpid())


STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
# What a worker serves: the app factory, ``create_app(settings)``, named as uvicorn names one.
APP_FACTORY = "gateway.app:create_app"
_MASKS = hasattr(signal, "pthread_sigmask")


def _stop_before_serving(sig: int, frame: FrameType | None) -> None:
    """A stop signal while the worker's server has no handlers of its own (before it serves, as it
    imports and builds the app, or after it has finished): nothing to drain, so the worker exits 0,
    as a drained one does. Before, the default action killed a worker still starting (status
    -SIGTERM) and the supervisor exited 1."""
    raise SystemExit(0)


def worker_main(config: str, host: str, port: int, log_level: str, sock: socket.socket, ready: Event) -> None:
    """One worker: the gateway of ``config`` on the inherited socket (runs in a spawned process);
    sets ``ready`` once it serves. It starts with the stop signals blocked (`Supervisor._start`), so
    that one sent while Python and multiprocessing start up waits for `_stop_before_serving`."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop_before_serving)  # until uvicorn installs its own (GatewayServer.handle_exit)
    if _MASKS:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # a stop that came meanwhile lands now
    metrics_pid_read_once()  # before create_app makes the metrics
    os.setpgrp()
    _die_with_parent()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <worker>` dumps its threads' stacks to stderr
    from uvicorn.importer import import_from_string

    from fleet_config import default_catalog, load_settings
    from gateway.serving.logs import configure_logging
    from gateway.serving.server import GatewayServer

    create_app = import_from_string(APP_FACTORY)  # by name, as uvicorn's --factory loads an app

    settings = load_settings(Path(config), default_catalog())  # the parent's `serve` checked it
    configure_logging(log_level, json_access_log=settings.gateway.access_log_format == "json")

    class Worker(GatewayServer):
        async def startup(self, sockets: list | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                ready.set()

    server = Worker(create_app(settings), settings, host=host, port=port, log_level=log_level.lower(),
                    access_log=False, admin_reuse_port=REUSE_PORT)
    server.run(sockets=[sock])
    raise SystemExit(1 if server.forced else 0)


class Supervisor:
    """Starts, replaces and stops the workers (module docstring).

    Args:
        config, host, port, log_level: what each worker serves (``serve``'s options).
        workers: how many, ≥ 1.
        stop_bound_s: after the first stop signal, workers still alive this long are killed
            (SIGKILL) and the exit status is 1: their own drain and grace are over by then
            (as Kubernetes kills a pod past its termination grace period).
    """

    target = staticmethod(worker_main)  # what a worker runs (a test puts a stubborn one here)

    def __init__(self, config: Path, host: str, port: int, log_level: str, workers: int, *,
                 stop_bound_s: float = 60.0) -> None:
        self.args = (str(config), host, port, log_level)
        self.n = workers
        self.ctx = multiprocessing.get_context("spawn")
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.signals = 0
        self.socks: list[socket.socket] = []  # worker i listens on socks[i]
        self.ready: dict[int | None, Event] = {}
        self.stop_bound_s = stop_bound_s
        self.first_signal_s: float | None = None
        self.reaped: set[int | None] = set()
        self.killed: set[int] = set()

    def run(self) -> int:
        """Serve until stopped; the exit status (0: every worker stopped cleanly; 3: the port
        could not be bound, as uvicorn exits on a start-up failure)."""
        try:
            self.socks = bind(self.args[1], self.args[2], self.n)
        except OSError as exc:
            log.error("cannot listen on %s:%d: %s", self.args[1], self.args[2], exc.strerror or exc)
            return 3
        metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        own_dir = metrics_dir is None
        if own_dir:
            metrics_dir = tempfile.mkdtemp(prefix="kappa-gateway-metrics-")
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by each worker at import
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._forward)
        try:
            for i in range(self.n):
                if self.first_signal_s is not None:
                    break  # stopped while starting (the listening sockets are closed): start no more
                self._start(i)
            log.info("serving on %s:%d with %d workers (pids %s)", self.args[1], self.args[2], self.n,
                     ", ".join(str(p.pid) for p in self.procs))
            return self._watch()
        finally:
            self._close_sockets()
            if own_dir:
                shutil.rmtree(metrics_dir, ignore_errors=True)

    def _close_sockets(self) -> None:
        """Close the parent's copies of the listening sockets (again is a no-op)."""
        for sock in set(self.socks):
            sock.close()

    def _start(self, i: int) -> None:
        """Start worker ``i``, on ``socks[i]``, as ``procs[i]`` (in the list before a stop signal can
        be handled here, so that `_forward` reaches it)."""
        ready = self.ctx.Event()
        proc = self.ctx.Process(target=self.target, args=(*self.args, self.socks[i], ready), name="kappa-gateway-worker")
        # The child inherits the signal mask through exec: a stop signal sent before it can handle one
        # stays pending until worker_main unblocks it (the parent's own is delivered when it unblocks here).
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS) if _MASKS else None
        try:
            if self.first_signal_s is not None:
                return  # stopped meanwhile: the listening sockets are closed, a worker would be stopped anyway
            proc.start()
            if i < len(self.procs):
                self.procs[i] = proc
            else:
                self.procs.append(proc)
            self.ready[proc.pid] = ready
        finally:
            if blocked is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _forward(self, sig: int, frame: FrameType | None) -> None:
        self.signals += 1
        if self.first_signal_s is None:
            self.first_signal_s = time.monotonic()
            # No worker is replaced from now on: the parent's copies of the listening sockets would
            # only keep the port open after the workers close theirs at the end of the drain, and
            # the kernel would queue new connections nobody accepts (clients hang until the last
            # worker exits) where they should be refused, as with one process.
            self._close_sockets()
        for proc in self.procs:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, sig)

    def _watch(self) -> int:
        from prometheus_client import multiprocess

        failed = False
        while any(p.exitcode is None for p in self.procs):
            wait([p.sentinel for p in self.procs if p.exitcode is None], timeout=WAIT_POLL_S)
            if self.first_signal_s is not None and time.monotonic() - self.first_signal_s > self.stop_bound_s:
                for proc in self.procs:
                    if proc.exitcode is None and proc.pid is not None and proc.pid not in self.killed:
                        log.error("worker %s still running %.0fs after the stop: killing it", proc.pid,
                                  self.stop_bound_s)
                        self.killed.add(proc.pid)
                        failed = True
                        os.kill(proc.pid, signal.SIGKILL)
            for i, proc in enumerate(self.procs):
                if proc.exitcode is None or proc.pid in self.reaped:
                    continue
                self.reaped.add(proc.pid)
                multiprocess.mark_process_dead(proc.pid)  # its live gauges leave the sums
                if self.signals:
                    continue
                if not self.ready.pop(proc.pid).is_set():
                    log.error("worker %s exited with status %s before it served: stopping", proc.pid, proc.exitcode)
                    failed = True
                    self._forward(signal.SIGTERM, None)
                    continue
                log.error("worker %s exited with status %s: starting another", proc.pid, proc.exitcode)
                self._start(i)
        codes = [p.exitcode for p in self.procs]
        if failed or any(code != 0 for code in codes):
            log.warning("workers exited with statuses %s", codes)
            return 1
        return 0
