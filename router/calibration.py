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


# Samples of each kind kept per backend (a sliding window, so a changed backend shows through).
KAPPA_FIT_WINDOW = 64
KAPPA_FIT_MIN_SAMPLES = 5
MIN_COMPUTE_SAMPLE_TOKENS = 256  # shorter prefills are dominated by the fixed per-step cost
TRANSFER_SAMPLE_MARGIN = 2.0  # K_host/T at least this many times the predicted κ_crit


@dataclass
class KappaCritFit:
    """Measured κ_crit of one backend, from TTFTs of requests that ran alone there.

    κ_crit is the ratio of the time to compute one new token to the time to load one cached
    token (DESIGN.md §3: "time per new token / time per loaded token"). Requests that found
    the backend idle (nothing in flight from this gateway) and had nothing to load give the
    first: TTFT/T; those far into the transfer-bound regime (K_host/T ≥ 2 × predicted κ_crit)
    give the second: TTFT/K_host. Each is the median of the latest ``KAPPA_FIT_WINDOW``
    samples; the fit answers once both have ``KAPPA_FIT_MIN_SAMPLES``.

    Args:
        predicted_kappa_crit: the profile's κ_crit, to pick transfer-bound samples.
    """

    predicted_kappa_crit: float
    _per_uncached_token_s: list[float] = field(default_factory=list)
    _per_loaded_token_s: list[float] = field(default_factory=list)

    def observe(self, *, uncached_prompt_tokens: int, cached_host_tokens: int, ttft_s: float, backend_idle: bool) -> None:
        """Fold in one request's measured TTFT (seconds) if it is a clean sample."""
        if not backend_idle or ttft_s <= 0:
            return
        if cached_host_tokens == 0 and uncached_prompt_tokens >= MIN_COMPUTE_SAMPLE_TOKENS:
            _push(self._per_uncached_token_s, ttft_s / uncached_prompt_tokens)
        elif cached_host_tokens > 0 and cached_host_tokens >= TRANSFER_SAMPLE_MARGIN * self.predicted_kappa_crit * max(
                uncached_prompt_tokens, 1):
            _push(self._per_loaded_token_s, ttft_s / cached_host_tokens)

    @property
    def samples(self) -> tuple[int, int]:
        """(compute-bound samples, transfer-bound samples) held."""
        return len(self._per_uncached_token_s), len(self._per_loaded_token_s)

    def kappa_crit(self) -> float | None:
        """Measured κ_crit, or None until both kinds of sample are plentiful enough."""
        if min(self.samples) < KAPPA_FIT_MIN_SAMPLES:
            return None
        return _median(self._per_uncached_token_s) / _median(self._per_loaded_token_s)


def _push(window: list[float], value: float) -> None:
    window.append(value)
    if len(window) > KAPPA_FIT_WINDOW:
        del window[0]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
