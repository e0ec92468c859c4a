"""A request's prompt token ids in the mock engine: the model's own tokenizer when it has one.

* With a tokenizer (the backend's model entry names one: ``models.<m>.tokenizer``, or
  ``kappa-gateway mock-vllm --tokenizer DIR``): `tokenization.request_token_ids`, the steps a
  vLLM engine takes (its chat template, then its ``tokenizer.json``), the very function the
  gateway calls to name the engine's blocks. A body it cannot tokenise is a 400, as vLLM
  answers a failed render or an out-of-vocabulary id.
* Without one: the mock's own deterministic tokenizer and ChatML-like template
  (`mock_vllm.tokenizer`), as before issue 30.

Either way ``usage.prompt_tokens`` is the length of these ids. Generated tokens stay synthetic
(`mock_vllm.tokenizer.token_text`).
"""

from __future__ import annotations

from mock_vllm import tokenizer as mock_tokenizer
from mock_vllm.openai_api import ApiError, ChatCompletionRequest, CompletionRequest
from tokenization import EngineTokenizer, request_token_ids


def chat_prompt_ids(body: ChatCompletionRequest, tok: EngineTokenizer | None) -> list[int]:
    """The prompt ids of a validated chat request.

    Raises:
        ApiError: 400 when the template cannot be rendered or the body not tokenised.
    """
    try:
        if tok is not None:
            return request_token_ids(tok, body.model_dump(exclude_unset=True), chat=True)
        return mock_tokenizer.encode(mock_tokenizer.apply_chat_template(body.message_dicts(), body.tools))
    except (ValueError, TypeError, RuntimeError) as exc:  # vLLM answers a failed render or tokenisation 400
        raise ApiError(400, f"The chat could not be rendered or tokenised: {exc.__class__.__name__}: {exc}") from exc


def completion_prompt_ids(body: CompletionRequest, tok: EngineTokenizer | None, model_vocab_size: int | None) -> list[int]:
    """The prompt ids of a validated completion request (one prompt: a string or token ids).

    Args:
        body: the request.
        tok: the model's tokenizer, or None for the mock's own.
        model_vocab_size: the catalog model's vocabulary, which token-id prompts are checked
            against without a tokenizer (None: the mock tokenizer's); with one, its own size.

    Raises:
        ApiError: 400 for a batch of several prompts, an id out of vocabulary, or an empty prompt.
    """
    prompt = body.single_prompt()
    if tok is not None:
        try:
            prompt_ids = request_token_ids(tok, body.model_dump(exclude_unset=True), chat=False)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="prompt") from exc
    elif isinstance(prompt, str):
        prompt_ids = mock_tokenizer.encode(prompt)
    else:
        vocab = model_vocab_size or mock_tokenizer.VOCAB_SIZE
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"Token id {bad} is out of vocabulary (size {vocab}).", param="prompt")
        prompt_ids = prompt
    if not prompt_ids:
        raise ApiError(400, "The prompt cannot be empty.", param="prompt")
    return prompt_ids
