"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from llmfast.structured_params import StructuredOutputs
from llmfast.utils.value_checks import describe, int_list, is_int, is_number

# OpenAI's range for logit_bias values: -100 bans a token, 100 all but forces it.
MAX_LOGIT_BIAS = 100.0

# Rows with temperature below this are sampled greedily.
GREEDY_TEMPERATURE = 1e-5
# Most top-n alternatives `logprobs` and `prompt_logprobs` may ask for (vLLM's default).
MAX_LOGPROBS = 20
# The largest float32: temperature and repetition_penalty are held as float32.
FLOAT32_MAX = 3.4028234663852886e38

_NUMBER_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty")
_INT_FIELDS = ("top_k", "max_tokens", "min_tokens")
_OPTIONAL_INT_FIELDS = ("seed", "logprobs", "prompt_logprobs")


class SamplingParamsError(ValueError):
    """Invalid sampling parameters; the message is one user-facing line."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request, in vLLM's vocabulary.

    temperature 0 means greedy; top_k 0 (or -1) and top_p 1 disable those filters.
    `stop` strings are matched by the engine on the detokenised text and are not part
    of the returned text (unless `include_stop_str_in_output`). `logprobs=n` returns the
    sampled token's logprob and the top n. `prompt_logprobs=n` returns, for every prompt
    token but the first, its logprob given the tokens before it and the top n (such a
    request takes no prefix-cache hits: cached tokens have no logits). `logit_bias`
    ({token id: bias in [-100, 100]}) is added to the logits and `allowed_token_ids` bans
    every other token, both before penalties and before the (sampled tokens') logprobs are
    taken (token ids must be in the model's vocabulary: the engine refuses others).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False  # vLLM's: the stop string stays in the text
    # A dict, so left out of the hash (the dataclass stays hashable).
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    allowed_token_ids: tuple[int, ...] | None = None
    # A JSON schema, regex, choice or grammar the output must follow (llmfast/structured/).
    structured: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        self._check_types()
        if self.structured is not None and not isinstance(self.structured, StructuredOutputs):
            raise SamplingParamsError(f"structured must be a StructuredOutputs, got "
                                      f"{describe(self.structured)}")
        # Accept lists or a single string from callers; store tuples (hashable, immutable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(
            int_list(self.stop_token_ids, "stop_token_ids", SamplingParamsError)))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(
                int_list(self.allowed_token_ids, "allowed_token_ids", SamplingParamsError)))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _checked_logit_bias(self.logit_bias))
        for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:  # numpy integers -> int
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _check_types(self) -> None:
        """Wrong types get a SamplingParamsError naming the field, not a TypeError from
        a comparison (and a float is not silently truncated to an int)."""
        for name in _NUMBER_FIELDS:
            value = getattr(self, name)
            if not is_number(value):
                raise SamplingParamsError(f"{name} must be a finite number, got {describe(value)}")
        for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
            value = getattr(self, name)
            if not is_int(value) and not (value is None and name in _OPTIONAL_INT_FIELDS):
                raise SamplingParamsError(f"{name} must be an integer, got {describe(value)}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(f"{name} must be True or False, got "
                                          f"{describe(getattr(self, name))}")
        if not isinstance(self.stop, (str, list, tuple)):
            raise SamplingParamsError(f"stop must be a string or a list of strings, got "
                                      f"{describe(self.stop)}")

    def _validate(self) -> None:
        def bad(msg: str) -> SamplingParamsError:
            return SamplingParamsError(msg)

        if not self.temperature >= 0.0:  # also rejects NaN
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        # The sampler holds these as float32: past its largest value they would become
        # infinities (an infinite temperature, a penalty dividing every logit to 0).
        for name in ("temperature", "repetition_penalty"):
            if getattr(self, name) > FLOAT32_MAX:
                raise bad(f"{name} must be at most {FLOAT32_MAX:.4g}, got {getattr(self, name)}")
        # Any size: one at or past the vocabulary means "off" (`fit_to_model`).
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be 0 (off), -1 (off) or a positive integer, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise bad(f"{name} must be in [-2, 2], got {value}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise bad(f"seed must be a non-negative integer, got {self.seed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop strings must be non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise bad(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids must not be empty (it would ban every token)")
            if min(self.allowed_token_ids) < 0:
                raise bad("allowed_token_ids must be non-negative")

    def token_ids_outside(self, vocab_size: int) -> str | None:
        """What names a token id this model does not have (`logit_bias`,
        `allowed_token_ids`), or None: the engine refuses such a request."""
        for what, ids in (("logit_bias", self.logit_bias or ()),
                          ("allowed_token_ids", self.allowed_token_ids or ())):
            if ids and max(ids) >= vocab_size:
                return f"{what} has token id {max(ids)}, outside the vocabulary [0, {vocab_size})"
        return None

    @property
    def has_logit_rules(self) -> bool:
        """Whether the sampler must edit this request's logits before anything else."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    def fit_to_model(self, vocab_size: int, max_model_len: int) -> SamplingParams:
        """The same request with every count cut to what can take effect on this model,
        so that no integer is too large for the engine's fixed-width per-request arrays
        (an overflow there would fail the whole step, and every request in it). Nothing
        observable changes: top_k at or past the vocabulary keeps every token, as 0 (off)
        does; no request outputs more than max_model_len tokens; a stop id outside the
        vocabulary is never sampled."""
        top_k = 0 if self.top_k >= vocab_size else self.top_k
        max_tokens = min(self.max_tokens, max_model_len)
        min_tokens = min(self.min_tokens, max_model_len)
        stop_ids = tuple(t for t in self.stop_token_ids if t < vocab_size)
        if (top_k, max_tokens, min_tokens, stop_ids) == (
                self.top_k, self.max_tokens, self.min_tokens, self.stop_token_ids):
            return self
        return dataclasses.replace(self, top_k=top_k, max_tokens=max_tokens,
                                   min_tokens=min_tokens, stop_token_ids=stop_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _checked_logit_bias(bias: object) -> dict[int, float]:
    """`bias` as {int token id: float}; a SamplingParamsError names what is wrong."""
    if not isinstance(bias, dict):
        raise SamplingParamsError(f"logit_bias must be a mapping of token id to bias, got "
                                  f"{describe(bias)}")
    out = {}
    for token, value in bias.items():
        if not is_int(token) or token < 0:
            raise SamplingParamsError(f"logit_bias keys must be non-negative token ids, got "
                                      f"{describe(token)}")
        if not is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise SamplingParamsError(f"logit_bias values must be numbers in [-100, 100], got "
                                      f"{describe(value)} for token {token}")
        out[int(token)] = float(value)
    return out


def seed_to_int64(seed: int) -> int:
    """Fold any non-negative Python int seed into the int64 the device holds per row
    (the sampler's `SamplingMetadata.seeds`; seeds >= 2**63 would overflow a numpy int64
    array): its low 64 bits, read as a signed value."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed
