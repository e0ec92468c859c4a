"""The gateway with its routing made free: the ceiling any routing code can reach on this stack.

A measurement harness for `bench/overhead.py --targets ...,relay` (issue 6), not a way to
run the gateway. It starts ``kappa-gateway serve`` with `gateway.routing.RoutingService`'s
per-request work memoised: ``parse`` (JSON, canonical bytes, hashing) is computed once per
distinct body, ``plan`` (index match, views, decision) once per distinct parsed request,
and ``record`` does nothing. Everything else is the real gateway: the fast path, reading
the body, the ledger and its tickets, the upstream call, the relay, usage parsing,
response headers and every metric. The benchmark cycles 16 distinct bodies per size, so
after warm-up routing costs nothing here; what this target loses to ``bare`` is the cost
of the gateway's relay and observability alone.

    python bench/relay_only.py serve --config FILE [serve options]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# The tree this script is in, not whatever an editable install points at (`python -m gateway`
# gets the same from its working directory: bench/overhead.py starts both from the tree's root).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hot_path  # noqa: E402

hot_path.select()  # this script is an entry point: compiled or source, before the project is imported

from gateway import routing  # noqa: E402
from gateway.commands.cli import main  # noqa: E402

_Service = routing.RoutingService
_parse, _plan = _Service.parse, _Service.plan
_parsed: dict[bytes, Any] = {}
_plans: dict[int, Any] = {}


def _memo_parse(self: routing.RoutingService, kind: routing.Kind, raw: bytes | bytearray) -> routing.ParsedRequest:
    key = bytes(raw)  # the gateway reads a body into one bytearray (gateway.edge.body): not hashable
    parsed = _parsed.get(key)
    if parsed is None:
        parsed = _parsed[key] = _parse(self, kind, raw)
    return parsed


async def _memo_plan(self: routing.RoutingService, parsed: routing.ParsedRequest) -> routing.RoutePlan:
    plan = _plans.get(id(parsed))
    if plan is None:
        plan = _plans[id(parsed)] = await _plan(self, parsed)
    return plan


async def _no_record(self: routing.RoutingService, *args: object, **kwargs: object) -> None:
    return None


if __name__ == "__main__":
    _Service.parse, _Service.plan, _Service.record = _memo_parse, _memo_plan, _no_record
    sys.argv[0] = "kappa-gateway"
    main()
