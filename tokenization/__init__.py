"""The engines' tokenizer: a request's token ids as a vLLM engine computes them (issue 30).

Public surface::

    engine_tokenizer  EngineTokenizer: a model's tokenizer directory (tokenizer.json,
                      tokenizer_config.json) loaded with Hugging Face ``tokenizers``; its chat
                      template; encoding as vLLM encodes each endpoint
    requests          request_token_ids(tok, body, chat=...): an OpenAI request body -> the
                      engine's prompt token ids (the mock and the gateway both call it)
    chat_template     ChatTemplate: a Jinja chat template rendered as transformers renders it
    train             ``python -m tokenization.train``: the mock's shipped byte-level BPE
                      (assets/tokenizers/kappa-mock-bpe), trained from text in this repo

Imports the standard library, ``tokenizers`` and ``jinja2`` only; the mock, the gateway and the
simulator import it. Where no tokenizer is configured, nothing here runs.
"""

from tokenization.chat_template import ChatTemplate
from tokenization.engine_tokenizer import EngineTokenizer
from tokenization.requests import request_token_ids

__all__ = ["ChatTemplate", "EngineTokenizer", "request_token_ids"]
