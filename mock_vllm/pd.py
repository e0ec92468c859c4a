"""Prefill/decode disaggregation as vLLM's NixlConnector runs it, for the mock backend.

Source: vLLM ``vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`` at commit
002a1057 (NIXL connector version 2: ``remote_request_id`` in ``kv_transfer_params``), its toy
proxy ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``, ``vllm/envs.py``
(``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``) and ``vllm/config/kv_transfer.py``
(``kv_load_failure_policy``). Described here, not copied.

The flow (a proxy or gateway drives it; every mock speaks both sides, as a NixlConnector does
whatever its ``kv_role``, which only says how the fleet uses it):

1. **Prefill** on p: the request carries ``kv_transfer_params: {"do_remote_decode": true,
   "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null,
   "remote_host": null, "remote_port": null}`` (and the proxy sets ``max_tokens`` 1, ``stream``
   false, drops ``stream_options``). p prefills it; when it finishes its blocks are *kept*
   (NixlConnector ``request_finished`` → ``delay_free_blocks``) and the non-streamed answer
   carries ``kv_transfer_params: {"do_remote_prefill": true, "do_remote_decode": false,
   "remote_block_ids": [...], "remote_engine_id": <p's engine id>, "remote_request_id": <p's
   request id>, "remote_host", "remote_port", "tp_size"}``. The blocks are released when a
   decode engine has read them, or after ``abort_request_timeout_s`` (vLLM's
   ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, default 480 s; counted in ``vllm:nixl_num_kv_expired_reqs``).
2. **Decode** on d: the original request plus those params. d finds its own prefix hit K_d first
   (``get_num_new_matched_tokens`` asks for P − K_d tokens), pulls only the blocks it lacks
   (the tail of ``remote_block_ids``, ``_read_blocks``), then decodes. The pull is a real HTTP
   exchange with p (`READ_PATH` at ``remote_host:remote_port``: p checks it holds those blocks
   and frees them, as NIXL's completion notification does), so a dead or stopped p fails it;
   its *time* is modelled: latency + bytes / bandwidth of ``link(p, d)`` from the fleet's
   ``interconnect`` (`router.links`), at the delivered bandwidth a link fault sets (`LinkFault`).
   d then admits the request with the whole prompt computed but its last token (vLLM recomputes
   it): usage ``cached_tokens`` is P − 1, as vLLM reports (its ``num_cached_tokens`` counts
   remotely computed tokens), and ``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``
   grows by P − K_d.
3. **A failed pull** (p dead, stopped past ``pull_timeout_s``, blocks expired, a link fault with
   ``fail``, no configured link) follows ``kv_load_failure_policy``: ``recompute`` prefills the
   missing part locally; ``fail`` (vLLM's default) ends the request with finish reason ``error``,
   which vLLM's server answers as a 500 ``Internal server error`` (`FAILED_LOAD_MESSAGE`).

Engine ids are the backends' ids (vLLM lets ``kv_transfer_config.engine_id`` be set), so
``remote_engine_id`` names the peer in the interconnect table directly. Not modelled: blocks d
allocates while it waits (vLLM's ``WAITING_FOR_REMOTE_KVS``; d's blocks are taken on admission),
several decode ranks reading one prefill (heterogeneous TP: the first read frees the blocks), and
RDMA reads that would still succeed from a stopped (SIGSTOP) process once the handshake was done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from router.links import NO_INTERCONNECT, Interconnect

if TYPE_CHECKING:
    from mock_vllm.engine import MockEngine
    from mock_vllm.nixl_metrics import NixlMetrics

KV_ROLES = ("prefill", "decode", "both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
DEFAULT_KV_LOAD_FAILURE_POLICY = "fail"  # vLLM's KVTransferConfig default
ABORT_REQUEST_TIMEOUT_S = 480.0  # VLLM_NIXL_ABORT_REQUEST_TIMEOUT's default, engine seconds here
# Wall seconds the side-channel read may take before the pull counts as failed: a live mock answers
# in milliseconds, so 5 s only ever expires on a stopped or unreachable prefill instance.
PULL_TIMEOUT_S = 5.0
READ_PATH = "/kappa/nixl/read"
FAILED_LOAD_MESSAGE = "Internal server error"  # vLLM's GenerationError for finish reason "error"
REMOTE_PREFILL_FIELDS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")


class PullFailed(Exception):
    """A remote KV read did not complete (the reason is the message)."""


class ReadRefused(Exception):
    """A side-channel read of blocks this engine does not hold: ``status`` 404 (none held for that
    request) or 409 (some ids are not that request's)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class PdSettings:
    """A mock's P/D settings.

    Attributes:
        engine_id: its NIXL engine id: the backend's id.
        kv_role: ``prefill``, ``decode`` or ``both`` (the config's ``kv_role``).
        interconnect: the fleet's links (`fleet_config.Settings.interconnect_table`).
        kv_load_failure_policy: ``recompute`` or ``fail`` (vLLM's default).
        abort_request_timeout_s: engine seconds held blocks wait for a reader, > 0.
        pull_timeout_s: wall seconds the side-channel read may take, > 0.
    """

    engine_id: str
    kv_role: str = "both"
    interconnect: Interconnect = NO_INTERCONNECT
    kv_load_failure_policy: str = DEFAULT_KV_LOAD_FAILURE_POLICY
    abort_request_timeout_s: float = ABORT_REQUEST_TIMEOUT_S
    pull_timeout_s: float = PULL_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, "
                             f"got {self.kv_load_failure_policy!r}")
        if not (self.abort_request_timeout_s > 0 and self.pull_timeout_s > 0):
            raise ValueError("abort_request_timeout_s and pull_timeout_s must be > 0")


@dataclass(frozen=True, slots=True)
class LinkFault:
    """What a link to a peer delivers instead of its configured figure (a test's or drill's fault).

    Attributes:
        delivered_bytes_per_s: bandwidth reads actually get, bytes/s (``None``: the configured one).
        fail: every read over the link fails.
    """

    delivered_bytes_per_s: float | None = None
    fail: bool = False


@dataclass(slots=True)
class _Held:
    block_ids: list[int]
    expiry: asyncio.TimerHandle


def remote_prefill_params(params: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``params`` when they ask for a remote prefill's KV with every field vLLM needs, else ``None``
    (vLLM warns about incomplete params and serves the request without a transfer)."""
    if not params or not params.get("do_remote_prefill") or not params.get("remote_block_ids"):
        return None
    return params if all(params.get(k) is not None for k in REMOTE_PREFILL_FIELDS) else None


@dataclass
class PdConnector:
    """One mock's side of the protocol (module docstring): holds, side channel, pulls, link faults.

    Lives on the server's event loop (nothing here is thread-safe); `start` and `close` are the
    server's lifespan's. ``time_scale`` is wall seconds per engine second.
    """

    settings: PdSettings
    engine: MockEngine
    metrics: NixlMetrics
    time_scale: float
    faults: dict[str, LinkFault] = field(default_factory=dict)  # peer backend id or "*" → fault
    pulls_in_flight: int = 0
    _held: dict[str, _Held] = field(default_factory=dict)
    _next_block_id: int = 0
    _session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()

    async def close(self) -> None:
        for held in self._held.values():
            held.expiry.cancel()
        self._held.clear()
        if self._session is not None:
            await self._session.close()

    # -- the prefill side ---------------------------------------------------------------------
    def on_kv_held(self, request_id: str, num_blocks: int) -> None:
        """A ``hold_kv`` request finished keeping ``num_blocks`` blocks: name them, start the timeout."""
        total = self.engine.stats.num_gpu_blocks
        ids = [(self._next_block_id + i) % total for i in range(num_blocks)]
        self._next_block_id = (self._next_block_id + num_blocks) % total
        delay_s = self.settings.abort_request_timeout_s * self.time_scale
        self._held[request_id] = _Held(ids, asyncio.get_running_loop().call_later(delay_s, self._expire, request_id))

    def transfer_params(self, request_id: str, host: str, port: int) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` a finished prefill answers with (NixlConnector ``request_finished``)."""
        held = self._held.get(request_id)
        if held is None:
            return None
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": list(held.block_ids),
                "remote_engine_id": self.settings.engine_id, "remote_request_id": request_id,
                "remote_host": host, "remote_port": port, "tp_size": self.engine.backend.tensor_parallel}

    def read(self, request_id: str, block_ids: Sequence[int]) -> int:
        """A decode engine read ``block_ids`` of ``request_id`` and notifies: free its blocks.

        Returns:
            How many blocks were freed.

        Raises:
            ReadRefused: none are held for ``request_id``, or some ids are not its.
        """
        held = self._held.get(request_id)
        if held is None:
            raise ReadRefused(404, f"no KV blocks held for request {request_id!r} (never held, read, or expired)")
        if not set(block_ids) <= set(held.block_ids):
            raise ReadRefused(409, f"blocks {sorted(set(block_ids) - set(held.block_ids))} are not held for "
                                   f"{request_id!r}")
        held.expiry.cancel()
        del self._held[request_id]
        self.engine.release_held(request_id)
        return len(held.block_ids)

    def _expire(self, request_id: str) -> None:
        if self._held.pop(request_id, None) is not None and self.engine.release_held(request_id):
            self.metrics.kv_expired_reqs.inc()

    # -- the decode side ----------------------------------------------------------------------
    def fault_for(self, peer: str) -> LinkFault | None:
        return self.faults.get(peer, self.faults.get("*"))

    async def pull(self, prompt_token_ids: Sequence[int], cache_salt: str | None,
                   params: Mapping[str, Any]) -> int | None:
        """Read the prompt blocks this engine lacks from the prefill engine ``params`` name.

        Returns:
            The first block that came from the remote engine (the add_request's
            ``remote_from_block``), or ``None`` when the read failed (counted in
            ``vllm:nixl_num_failed_transfers``); the caller applies the failure policy.
        """
        block_size = self.engine.block_size
        local_blocks = self.engine.local_prefix_blocks(prompt_token_ids, cache_salt)
        remote_ids = list(params["remote_block_ids"])
        n = min(-(-len(prompt_token_ids) // block_size) - local_blocks, len(remote_ids))
        read_ids = remote_ids[len(remote_ids) - n:] if n > 0 else []
        self.pulls_in_flight += 1
        try:
            duration_s = self._transfer_s(str(params["remote_engine_id"]), n * self.engine.block_bytes)
            await asyncio.sleep(duration_s * self.time_scale)
            await self._notify(params, read_ids)
        except PullFailed:
            if not read_ids:  # nothing to read: only the notification failed; p frees on its timeout
                self.metrics.failed_notifications.inc()
                return local_blocks
            self.metrics.failed_transfers.inc()
            return None
        finally:
            self.pulls_in_flight -= 1
        if read_ids:
            model = self.engine.backend.model
            regions = model.num_layers * (1 if model.kv_lora_rank else 2)  # K and V apart, one latent with MLA
            link = self.settings.interconnect.link(str(params["remote_engine_id"]), self.settings.engine_id)
            self.metrics.record_transfer(duration_s=duration_s, post_s=link.latency_s if link else 0.0,
                                         num_bytes=n * self.engine.block_bytes, descriptors_per_rank=regions * n,
                                         ranks=self.engine.backend.tensor_parallel)
        return local_blocks

    def _transfer_s(self, peer: str, num_bytes: float) -> float:
        link = self.settings.interconnect.link(peer, self.settings.engine_id)
        fault = self.fault_for(peer)
        if link is None:
            raise PullFailed(f"no interconnect link from {peer!r} to {self.settings.engine_id!r}")
        if fault is not None and fault.fail:
            raise PullFailed(f"link from {peer!r} is failed (fault)")
        if num_bytes <= 0:
            return 0.0
        bandwidth = fault.delivered_bytes_per_s if fault and fault.delivered_bytes_per_s else link.bandwidth_bytes_per_s
        return link.latency_s + num_bytes / bandwidth

    async def _notify(self, params: Mapping[str, Any], block_ids: list[int]) -> None:
        assert self._session is not None, "PdConnector.start() was not called"
        url = f"http://{params['remote_host']}:{params['remote_port']}{READ_PATH}"
        body = {"remote_request_id": params["remote_request_id"], "block_ids": block_ids,
                "engine_id": self.settings.engine_id, "tp_size": self.engine.backend.tensor_parallel}
        timeout = aiohttp.ClientTimeout(total=self.settings.pull_timeout_s)
        try:
            async with self._session.post(url, json=body, timeout=timeout) as response:
                if response.status != 200:
                    raise PullFailed(f"{url} answered {response.status}: {await response.text()}")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise PullFailed(f"{url}: {exc!r}") from exc
