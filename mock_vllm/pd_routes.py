"""The mock's P/D routes: the NIXL side channel and the link-fault knob (`mock_vllm.pd`).

* ``POST /kappa/nixl/read`` (`mock_vllm.pd.READ_PATH`), on a prefill instance, called by a decode
  instance when its modelled read of held blocks completes: ``{"remote_request_id": str,
  "block_ids": [int], "engine_id": str, "tp_size": int}``. 200 ``{"released_blocks": n}`` when
  those blocks were held for that request (they are freed: NIXL's completion notification); 404
  when none are held (never, already read, or expired); 409 when some ids are not that request's.
* ``GET /kappa/nixl/meta``: what a NIXL handshake would exchange: engine id, role, TP size, block
  size and bytes, KV blocks, requests whose blocks are held.
* ``POST /kappa/faults/link`` ``{"peer": "<backend id>" | "*", "delivered_gb_s": float > 0 | null,
  "fail": bool}``: reads from that peer (``*``: any peer without a fault of its own) get this
  bandwidth instead of the configured one, or fail. ``DELETE /kappa/faults/link[?peer=ID]`` resets
  one peer's fault, or all; ``GET /kappa/faults/link`` lists them, in GB/s.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from mock_vllm.openai_api import ApiError
from mock_vllm.pd import READ_PATH, LinkFault, PdConnector, ReadRefused
from router.profiles import GB

routes = APIRouter()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReadNotification(_Strict):
    remote_request_id: str
    block_ids: list[int]
    engine_id: str | None = None
    tp_size: Annotated[int, Field(ge=1)] = 1


class LinkFaultBody(_Strict):
    peer: Annotated[str, Field(min_length=1)]
    delivered_gb_s: Annotated[float, Field(gt=0)] | None = None
    fail: bool = False


def _pd(request: Request) -> PdConnector:
    return request.state.mock.pd


@routes.post(READ_PATH)
async def read_blocks(body: ReadNotification, request: Request) -> dict[str, int]:
    try:
        return {"released_blocks": _pd(request).read(body.remote_request_id, body.block_ids)}
    except ReadRefused as exc:
        raise ApiError(exc.status, str(exc), param="remote_request_id") from exc


@routes.get("/kappa/nixl/meta")
async def nixl_meta(request: Request) -> dict[str, Any]:
    pd = _pd(request)
    engine = pd.engine
    return {"engine_id": pd.settings.engine_id, "kv_role": pd.settings.kv_role,
            "tp_size": engine.backend.tensor_parallel, "block_size": engine.block_size,
            "block_bytes": engine.block_bytes, "num_blocks": engine.stats.num_gpu_blocks,
            "kv_load_failure_policy": pd.settings.kv_load_failure_policy,
            "held_request_ids": engine.held_request_ids}


def _faults(pd: PdConnector) -> dict[str, Any]:
    return {"faults": {peer: {"delivered_gb_s": None if f.delivered_bytes_per_s is None else f.delivered_bytes_per_s / GB,
                              "fail": f.fail} for peer, f in sorted(pd.faults.items())}}


@routes.post("/kappa/faults/link")
async def set_link_fault(body: LinkFaultBody, request: Request) -> dict[str, Any]:
    pd = _pd(request)
    if body.delivered_gb_s is None and not body.fail:
        raise ApiError(400, "a link fault sets delivered_gb_s, fail, or both (DELETE resets it)", param="peer")
    delivered = None if body.delivered_gb_s is None else body.delivered_gb_s * GB
    pd.faults[body.peer] = LinkFault(delivered_bytes_per_s=delivered, fail=body.fail)
    return _faults(pd)


@routes.delete("/kappa/faults/link")
async def reset_link_fault(request: Request, peer: str | None = None) -> dict[str, Any]:
    pd = _pd(request)
    if peer is None:
        pd.faults.clear()
    else:
        pd.faults.pop(peer, None)
    return _faults(pd)


@routes.get("/kappa/faults/link")
async def link_faults(request: Request) -> dict[str, Any]:
    return _faults(_pd(request))
