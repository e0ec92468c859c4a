"""Process logging for ``serve`` and its workers: uvicorn's level names, the access log's JSON lines
bare, and no secret in a logged URL.

A client may send a key as a query parameter (``?api_key=...``, ``?key=...``, as some SDKs do),
and uvicorn logs the query string: its access log line (``uvicorn.access``) and, at ``trace``,
the whole ASGI scope (``uvicorn.asgi``, `uvicorn.middleware.message_logger`; it hides headers
and bodies, not ``query_string``). `RedactUrls`, on every handler `configure_logging` installs,
rewrites each record before it is formatted: every query parameter's value, the password of a
URL's userinfo (``redis://:pw@host``) and a known secret parameter anywhere
(`SECRET_PARAMS`) become ``<redacted>``; a scope's ``query_string`` likewise. Names stay, so a
line still says which parameters were sent.
"""

from __future__ import annotations

import logging
import re
from typing import Any

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


REDACTED = "<redacted>"
SECRET_PARAMS = ("api_key", "api-key", "apikey", "key", "token", "access_token", "password", "secret")
_QUERY_VALUE = re.compile(r"([?&][^=&\s\"'#?]+=)[^&\s\"'#]*")
_SECRET_VALUE = re.compile(r"(?i)((?<![\w-])(?:%s)=)[^&\s\"',;]*" % "|".join(re.escape(p) for p in SECRET_PARAMS))
_USERINFO = re.compile(r"(://[^/\s:@]*:)[^/\s@]*@")


def redact_text(text: str) -> str:
    """``text`` with query values, userinfo passwords and secret parameters redacted."""
    if "=" in text:
        text = _SECRET_VALUE.sub(r"\1" + REDACTED, _QUERY_VALUE.sub(r"\1" + REDACTED, text))
    if "@" in text:
        text = _USERINFO.sub(r"\1" + REDACTED + "@", text)
    return text


def _redact(value: Any) -> Any:
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict) and value.get("query_string"):  # an ASGI scope (uvicorn.asgi at trace)
        return {**value, "query_string": REDACTED.encode()}
    return value


class RedactUrls(logging.Filter):
    """A handler filter: the record's message and arguments redacted (module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == ACCESS_LOGGER:
            # The gateway's access log writes its own fields (`gateway.edge.access_log`: ids, route, model,
            # figures), never a URL: scanning its line, one per request, would cost ~11 µs for nothing.
            return True
        if isinstance(record.msg, str):
            record.msg = redact_text(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(_redact(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _redact(v) for k, v in record.args.items()}
        return True


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
    redact_log_handlers()


# Loggers whose handlers format what the gateway and uvicorn log (uvicorn's own config gives
# "uvicorn" and "uvicorn.access" handlers of their own that do not propagate to the root).
LOGGERS = ("", ACCESS_LOGGER, "uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")


def redact_log_handlers() -> None:
    """Put `RedactUrls` on every handler of `LOGGERS` (once each): called by `configure_logging`,
    and again once uvicorn configured its loggers (`gateway.serving.server.GatewayServer`)."""
    for name in LOGGERS:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactUrls) for f in handler.filters):
                handler.addFilter(RedactUrls())
