"""The index's guess of where a request's cached tokens were, checked against what the engine loaded.

A request's ``usage`` says how many of its prompt tokens were cached, not where: in HBM (read in
place) or in the host tier or a KV pool (loaded first). The gateway splits them as its index
estimated (`dispatch.prefill_feed.tiers`), and on ordinary traffic that estimate is wrong for about
a third of the requests that load anything (measured in the simulator on the Mooncake trace: the
engine keeps its own LRU order, shared with the KV of the requests it runs) — enough to drag a
link's measured factor far off (a B200 whose link was as profiled read 0.6).

vLLM counts the tokens it loaded — ``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``,
host tier and KV connectors, counted when a request is scheduled — so between two scrapes the
engine says how many tokens its requests admitted in that window loaded. A window checks when the
index's estimates of the requests the replay admitted in it (`dispatch.prefill_schedule`: each
request's first step's start) add up to that count within `TOLERANCE_TOKENS` per request plus
`TOLERANCE_RATIO`; their tiers are then trusted, else none of them is. A request whose admission
lies within its uncertainty of a window's edge joins the two windows into one check; one whose
admission is unknown (no first-token time, no usage) fails every window it may have fallen in.
Without the counter (an engine that does not export it) every estimate is trusted, as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

TOLERANCE_TOKENS = 64  # per request: block rounding (the index's 64-token blocks against vLLM's 16)
TOLERANCE_RATIO = 0.02  # of the tokens loaded: the bytes-per-token estimate's own error
MAX_SCRAPES = 512  # scrapes kept (at 1 s, eight minutes: longer than any request waits to be laid out)


class Admitted(Protocol):
    """What the check reads and writes of a request (`dispatch.prefill_schedule`'s entries)."""

    sent_s: float
    finished_s: float | None
    admitted_s: float | None  # when its first step began (None: unknown)
    admitted_margin_s: float  # how far off that may be
    verified: bool | None  # set here: its tiers agree with the engine's count (None: not decided)

    @property
    def loaded_tokens(self) -> float | None:
        """Host-tier and pool tokens the index says it loaded (None: unknown)."""


class LoadedTokensCheck:
    """Windows between scrapes of the engine's loaded-token counter, and the requests admitted in them."""

    def __init__(self) -> None:
        self._scrapes: list[tuple[float, float]] = []  # (time, cumulative loaded tokens), oldest first
        self.exported = False

    def scraped(self, now_s: float, loaded_tokens_total: float | None) -> None:
        """A scrape at ``now_s`` read the counter (None: not exported; a lower value: a restart)."""
        if loaded_tokens_total is None:
            self.exported, self._scrapes = False, []
            return
        if self._scrapes and loaded_tokens_total < self._scrapes[-1][1]:
            self._scrapes = []
        self.exported = True
        self._scrapes.append((now_s, loaded_tokens_total))
        del self._scrapes[:-MAX_SCRAPES]

    def settle(self, entries: Iterable[Admitted], known_until_s: float) -> None:
        """Decide the windows that end before ``known_until_s`` (every request admitted before then is
        laid out): each undecided entry admitted in one gets ``verified``."""
        pending = [e for e in entries if e.verified is None]
        if not self.exported:
            for e in pending:
                e.verified = True
            return
        scrapes = self._scrapes
        unknown = [e for e in pending if e.admitted_s is None]
        spans: list[tuple[int, int, Admitted]] = []
        for e in pending:
            if e.admitted_s is None:
                e.verified = False  # its steps are spoiled anyway (`dispatch.prefill_schedule`)
                continue
            lo = _window(scrapes, e.admitted_s - e.admitted_margin_s)
            if lo == 0:  # before the first scrape kept: no count to check it against
                e.verified = False
                continue
            spans.append((lo, _window(scrapes, e.admitted_s + e.admitted_margin_s), e))
        spans.sort(key=lambda span: span[0])
        groups: list[tuple[int, int, list[Admitted]]] = []  # (first window, last window, entries)
        for lo, hi, e in spans:
            if groups and lo <= groups[-1][1]:
                first, last, members = groups[-1]
                groups[-1] = (first, max(hi, last), [*members, e])
            else:
                groups.append((lo, hi, [e]))
        for first, last, members in groups:
            if last >= len(scrapes) or scrapes[last][0] > known_until_s:
                break  # not over yet, or some request admitted in it may not be laid out
            start_s, end_s = scrapes[first - 1][0], scrapes[last][0]
            blind = any(u.sent_s <= end_s and (u.finished_s is None or u.finished_s >= start_s) for u in unknown)
            estimates = [e.loaded_tokens for e in members]
            counted = scrapes[last][1] - scrapes[first - 1][1]
            ok = not blind and None not in estimates and abs(sum(x or 0.0 for x in estimates) - counted) <= (
                TOLERANCE_TOKENS * len(members) + TOLERANCE_RATIO * counted)
            for e in members:
                e.verified = ok


def _window(scrapes: list[tuple[float, float]], at_s: float) -> int:
    """The window ``at_s`` falls in: k with scrapes[k − 1] < at_s ≤ scrapes[k]; 0 before the first scrape,
    len(scrapes) after the last (a window not closed yet)."""
    lo, hi = 0, len(scrapes)
    while lo < hi:
        mid = (lo + hi) // 2
        if scrapes[mid][0] >= at_s:
            hi = mid
        else:
            lo = mid + 1
    return lo
