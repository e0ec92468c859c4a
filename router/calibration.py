"""Online calibration from what backends report back.

`BytesPerToken`: the gateway estimates prompt tokens from canonical prompt bytes; each
response's ``usage.prompt_tokens`` tells the truth for that model's tokenizer, so the
estimate follows the ratio of exponentially weighted sums of bytes and of tokens per model:
a token-weighted mean, so that a few short requests ("Hello", 9 tokens of chat template
and all) cannot move the estimate the next 17k-token prompt is priced with. (The index's
block size in *bytes* never changes — hashes must stay stable — only how many tokens a
block is taken to hold.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Weight of each new sample in the moving average: ~50 requests to converge.
DEFAULT_EMA_WEIGHT = 0.02
# Ignore samples outside this bytes/token range (a wrong usage field, an image-heavy prompt).
PLAUSIBLE_BYTES_PER_TOKEN = (0.5, 32.0)


@dataclass
class BytesPerToken:
    """Per-model bytes-per-token estimate; ``default`` until a model has samples.

    Args:
        default: the starting estimate (`prefix_index.hashing.BYTES_PER_TOKEN_ESTIMATE`).
        ema_weight: weight of a new sample, in (0, 1].
    """

    default: float
    ema_weight: float = DEFAULT_EMA_WEIGHT
    _by_model: dict[str, float] = field(default_factory=dict)
    _sums: dict[str, tuple[float, float]] = field(default_factory=dict)  # weighted (bytes, tokens)
    samples: dict[str, int] = field(default_factory=dict)

    def get(self, model: str) -> float:
        return self._by_model.get(model, self.default)

    def observe(self, model: str, prompt_bytes: int, prompt_tokens: int) -> bool:
        """Fold in one response's usage. Returns False when the sample was implausible and ignored."""
        if prompt_tokens <= 0 or prompt_bytes <= 0:
            return False
        sample = prompt_bytes / prompt_tokens
        lo, hi = PLAUSIBLE_BYTES_PER_TOKEN
        if not lo <= sample <= hi:
            return False
        n = self.samples.get(model, 0)
        total_bytes, total_tokens = self._sums.get(model, (0.0, 0.0))
        # The first samples weigh more (1/n) until the EMA weight takes over.
        weight = max(1.0 / (n + 1), self.ema_weight)
        total_bytes += weight * (prompt_bytes - total_bytes)
        total_tokens += weight * (prompt_tokens - total_tokens)
        self._sums[model] = (total_bytes, total_tokens)
        self._by_model[model] = total_bytes / total_tokens
        self.samples[model] = n + 1
        return True
