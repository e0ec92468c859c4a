"""Route dependencies: the app's `GatewayState`, read from the lifespan's request state."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from gateway.state import GatewayState


async def get_state(request: Request) -> GatewayState:
    # async: FastAPI runs a plain `def` dependency in a worker thread, a thread hop per request
    return request.state.gateway


State = Annotated[GatewayState, Depends(get_state)]
