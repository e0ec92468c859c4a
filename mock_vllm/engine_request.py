"""One request's state inside the mock engine (`mock_vllm.engine`): its prompt, progress and KV blocks.

Internal to the engine; kept in a module of its own so that the scheduler's module holds the
scheduling and the roofline, not the bookkeeping fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mock_vllm.vllm_block_hash import BlockChain


@dataclass(slots=True, eq=False)  # identity equality: `in`/`remove` on the running list stay cheap
class EngineRequest:
    """A request from `MockEngine.add_request` until it finishes or is aborted.

    P/D fields (`mock_vllm.pd`): ``hold_kv`` keeps its KV blocks referenced after it finishes
    (a prefill for a remote decode, vLLM's ``do_remote_decode``); ``remote_from_block`` is the
    first prompt block a remote engine delivered (``do_remote_prefill``: the blocks from there to
    the end of the prompt were pulled before the request was added), ``None`` for a local prefill.
    """

    request_id: str
    prompt_len: int
    max_tokens: int
    hashes: list[int]
    arrival_s: float
    prefill_target: int = 0  # tokens to prefill before the next token: the prompt, or after a
    #                          preemption the prompt plus all but the last generated token
    computed: int = 0  # tokens whose KV exists (cached, prefilled or decoded)
    generated: int = 0
    cached_tokens: int = 0  # prefix hit at the latest admission
    cached_host_tokens: int = 0
    cached_kv_pool_tokens: int = 0
    admitted: bool = False  # scheduled at least once (a preempted request is re-admitted)
    scheduled_s: float | None = None  # start of the step that first scheduled it (engine s)
    held_hashes: list[int] = field(default_factory=list)  # cached blocks referenced, in order
    anonymous_blocks: int = 0
    hold_kv: bool = False
    remote_from_block: int | None = None
    event_chain: BlockChain | None = None  # its blocks as vLLM names them, when KV events are on

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prefill_target

    @property
    def blocks_held(self) -> int:
        return len(self.held_hashes) + self.anonymous_blocks
