"""Workloads for the simulator, by name: real traces and generators, as `sim.traces.TraceRequest` lists.

Every workload is a function ``(n, seed) -> list[TraceRequest]`` at its own rate (scale it
with `sim.runner.scale_rate`), registered in `WORKLOADS` under the name
``kappa-gateway sim --workload NAME`` takes:

==========================  ======================================================  =========
name                        what                                                    prefixes
==========================  ======================================================  =========
``mooncake``                the real Mooncake conversation trace (first n records)   real
``mooncake-like``           `mooncake_like`: its statistics, generated              chat-like
``azure-conv``, ``azure-code``  the real Azure LLM inference 2023 traces: real       none
                            lengths and arrivals (Splitwise, ISCA'24, CC-BY 4.0)
``chat``                    `multi_turn_chat`: shared system prompt, whole history  growing
``chat-sliding-window``     the same chats truncated to a 4,096-token window         collapse
``document-qa``             `document_qa`: 12 long documents, short questions       κ ~ 10³
``agentic-coding``          `agentic_coding`: append-only growing contexts          κ ~ 10
==========================  ======================================================  =========

``chat`` and ``chat-sliding-window`` also come with their chat messages
(``build_workload(name, n, seed, messages=True)``): what a live gateway and ``kappa-gateway analyze``
need to see a sliding window (`sim.workloads.chat`).

The real traces are read from ``../shared/data`` beside the repository (`sim.real_traces`:
their sources, licences and generated stand-ins; the README's "Real traces"); where a file is
absent they raise `FileNotFoundError` saying where to get it and which workload stands in. Generated rates at scale 1 are
`RATES_RPS` (a session workload reaches about that rate once its warm-up has passed); where
each workload's knee lies on the shipped fleets — at scale ≈ 0.5–1 for document QA and agentic
coding, ≈ 4–8 for chat — is measured in BENCHMARKS.md "Routing quality" (`bench/routing_quality.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sim.real_traces import require_real_trace
from sim.traces import TraceRequest, load_azure, load_mooncake
from sim.workloads.agentic import agentic_coding
from sim.workloads.chat import DEFAULT_WINDOW_TOKENS, multi_turn_chat
from sim.workloads.document_qa import document_qa
from sim.workloads.mooncake_like import mooncake_like
from sim.workloads.sessions import shareable_prefix_tokens

__all__ = ["WORKLOADS", "RATES_RPS", "Workload", "agentic_coding", "build_workload",
           "document_qa", "mooncake_like", "multi_turn_chat", "shareable_prefix_tokens"]

RATES_RPS = {
    "mooncake-like": 3.4,  # the Mooncake conversation trace's mean rate (12,031 requests in 3,537 s)
    "chat": 4.0,
    "chat-sliding-window": 4.0,  # the same conversations as "chat"
    "document-qa": 2.0,
    "agentic-coding": 2.0,
}
"""Mean arrival rate of each generated workload at rate scale 1, requests/s."""


@dataclass(frozen=True, slots=True)
class Workload:
    """A named workload: ``build(n, seed)`` gives its first ``n`` requests (a real trace ignores the seed);
    ``build_messages(n, seed)`` the same records with their chat messages, where the workload has them."""

    name: str
    build: Callable[[int, int], list[TraceRequest]]
    real: bool
    description: str
    build_messages: Callable[[int, int], list[TraceRequest]] | None = None


def _registry() -> dict[str, Workload]:
    out = {"mooncake": Workload("mooncake", lambda n, seed: load_mooncake(require_real_trace("mooncake"), limit=n),
                                True, "the real Mooncake conversation trace")}
    for name in ("azure-conv", "azure-code"):
        out[name] = Workload(name, lambda n, seed, name=name: load_azure(require_real_trace(name), limit=n), True,
                             f"the real Azure LLM inference 2023 trace ({name.removeprefix('azure-')}), no prefixes")
    generated = {
        "mooncake-like": (lambda n, seed: mooncake_like(n, rate_rps=RATES_RPS["mooncake-like"], seed=seed),
                          "Mooncake-like conversations"),
        "chat": (lambda n, seed: multi_turn_chat(n, rate_rps=RATES_RPS["chat"], seed=seed),
                 "multi-turn chat, whole history"),
        "chat-sliding-window": (lambda n, seed: multi_turn_chat(n, rate_rps=RATES_RPS["chat-sliding-window"],
                                                                seed=seed, window_tokens=DEFAULT_WINDOW_TOKENS),
                                f"multi-turn chat truncated to a {DEFAULT_WINDOW_TOKENS}-token window"),
        "document-qa": (lambda n, seed: document_qa(n, rate_rps=RATES_RPS["document-qa"], seed=seed),
                        "short questions on a few long documents"),
        "agentic-coding": (lambda n, seed: agentic_coding(n, rate_rps=RATES_RPS["agentic-coding"], seed=seed),
                           "coding-agent sessions, append-only contexts"),
    }
    windows = {"chat": None, "chat-sliding-window": DEFAULT_WINDOW_TOKENS}
    for name, (build, description) in generated.items():
        out[name] = Workload(name, build, False, description,
                             _chat_with_messages(RATES_RPS[name], windows[name]) if name in windows else None)
    return out


def _chat_with_messages(rate_rps: float, window_tokens: int | None) -> Callable[[int, int], list[TraceRequest]]:
    """The chat workload's builder with its messages (`sim.workloads.chat`)."""
    def build(n: int, seed: int) -> list[TraceRequest]:
        return multi_turn_chat(n, rate_rps=rate_rps, seed=seed, window_tokens=window_tokens, messages=True)
    return build


WORKLOADS: dict[str, Workload] = _registry()


def build_workload(name: str, n: int, seed: int = 0, *, messages: bool = False) -> list[TraceRequest]:
    """The first ``n`` requests of workload ``name`` at rate scale 1 (``messages``: with their chat
    messages, `Workload.build_messages`).

    Raises:
        ValueError: an unknown name, or ``messages`` for a workload without them.
        FileNotFoundError: a real trace's file is absent (`sim.real_traces.missing_message`).
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
    workload = WORKLOADS[name]
    if not messages:
        return workload.build(n, seed)
    if workload.build_messages is None:
        with_them = ", ".join(w.name for w in WORKLOADS.values() if w.build_messages is not None)
        raise ValueError(f"workload {name!r} has no chat messages (those that do: {with_them})")
    return workload.build_messages(n, seed)
