"""Route dependencies: the app's `GatewayState`, read from the lifespan's request state."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from gateway.state import GatewayState


def get_state(request: Request) -> GatewayState:
    return request.state.gateway


State = Annotated[GatewayState, Depends(get_state)]
