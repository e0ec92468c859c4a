"""Process logging for ``serve`` and its workers: uvicorn's level names, the access log's JSON lines bare."""

from __future__ import annotations

import logging

from uvicorn.config import LOG_LEVELS
from uvicorn.logging import TRACE_LOG_LEVEL

from gateway.edge.access_log import ACCESS_LOGGER


def log_level_number(log_level: str) -> int:
    """The ``logging`` level of one of uvicorn's level names (``trace`` included, any case).

    Raises:
        ValueError: not one of uvicorn's names (the message lists them).
    """
    level = LOG_LEVELS.get(log_level.lower())
    if level is None:
        raise ValueError(f"{log_level!r}: one of {', '.join(LOG_LEVELS)}")
    return level


def configure_logging(log_level: str, *, json_access_log: bool) -> None:
    """Root logging at ``log_level`` (uvicorn's names, ``trace`` included); the access log's JSON
    lines, when configured, go to stderr bare (no prefix), so each line parses as JSON.

    Raises:
        ValueError: an unknown level name (`log_level_number`).
    """
    logging.addLevelName(TRACE_LOG_LEVEL, "TRACE")  # uvicorn's level below DEBUG
    logging.basicConfig(level=log_level_number(log_level), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if json_access_log:
        access = logging.getLogger(ACCESS_LOGGER)
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        access.addHandler(handler)
        access.propagate = False
