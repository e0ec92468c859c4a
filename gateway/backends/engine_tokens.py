"""The engines' token ids for a request, for the exact (event-fed) index (issue 30).

A model whose ``models.<m>.tokenizer`` names a directory (made absolute when the config was
read: `fleet_config.settings.load_settings`) gets its tokenizer loaded once at start-up; the
gateway then turns a request body into the token ids its engine computes
(`tokenization.request_token_ids`: the chat template rendered and encoded as vLLM does), and the
KV-event index (`gateway.backends.kv_events_fleet`) matches them against the blocks each engine
announced. A model without a tokenizer routes on the approximate index, as before.

Cost. Hugging Face ``tokenizers`` takes about 5.5 ms for an 8k-token chat and 190 ms for a
128k-token one on one core of this machine (BENCHMARKS.md, "Exact prefix index"); it releases
the GIL while it encodes. So a prompt above `INLINE_MAX_BYTES` is encoded in a worker thread
(`asyncio.to_thread`) and the event loop keeps relaying other streams meanwhile; a short prompt
is encoded inline, where a thread hop would cost more than the encoding.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fleet_config import Settings
from gateway.backends.kv_events_fleet import TokenIdsOf
from tokenization import EngineTokenizer, request_token_ids

__all__ = ["INLINE_MAX_BYTES", "load_model_tokenizers", "tokenize_with"]

log = logging.getLogger("kappa_gateway.kv_events")

# Prompts up to this many bytes (~1k tokens at ~4 bytes/token, ~0.5 ms to encode) are tokenised
# on the event loop; longer ones in a worker thread.
INLINE_MAX_BYTES = 4096


def load_model_tokenizers(settings: Settings) -> dict[str, EngineTokenizer]:
    """The tokenizer of every served model whose ``models`` entry names one, loaded once.

    Returns:
        Served model name -> its tokenizer.

    Raises:
        ValueError: a tokenizer directory that cannot be loaded (the message names the setting).
    """
    out: dict[str, EngineTokenizer] = {}
    for model in settings.served_models():
        entry = settings.models.get(model)
        if entry is None or entry.tokenizer is None:
            continue
        try:
            out[model] = EngineTokenizer.from_dir(entry.tokenizer)
        except ValueError as exc:
            raise ValueError(f"models.{model}.tokenizer: {exc}") from exc
        log.info("model %s: tokenising with %s (%d ids) for the exact prefix index", model, entry.tokenizer,
                 out[model].vocab_size)
    return out


def tokenize_with(tokenizers: Mapping[str, EngineTokenizer]) -> TokenIdsOf | None:
    """The gateway's ``(model, body, chat) -> token ids | None`` over ``tokenizers`` (None: no model has one).

    Raises (from the returned function): ValueError for a body the tokenizer cannot take (the
    caller routes it approximately).
    """
    if not tokenizers:
        return None

    def tokenize(model: str, body: Mapping[str, Any], chat: bool) -> Sequence[int] | None:
        tok = tokenizers.get(model)
        return None if tok is None else request_token_ids(tok, body, chat=chat)

    return tokenize
