"""Per-request sampling parameters."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

# NOTE: vLLM's rule (`_MAX_TEMP`): a positive temperature below this divides the logits
# into inf / NaN in float32, so it is raised to it (with a warning there; a documented
# rule here).
MIN_TEMPERATURE = 1e-2
_F32_MAX = float(np.finfo(np.float32).max)
_INT32_MAX = 2 ** 31 - 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    Invariants (checked in `__post_init__`, ValueError otherwise), so that every value
    fits the step's per-row arrays (top_k int32, temperature / top_p float32, seed
    uint32):
        max_tokens >= 1; temperature >= 0 and at most float32's largest (a positive
        temperature below `MIN_TEMPERATURE` is stored as `MIN_TEMPERATURE`, as vLLM);
        top_k in [0, 2**31 - 1] (0 = whole vocab; -1 is accepted as in vLLM and stored
        as 0); 0 < top_p <= 1 and above 0 as a float32; seed is None or a non-negative
        int below 2**32; stop token ids are non-negative ints.

    Attributes:
        max_tokens: the most output tokens to generate (finish reason "length").
        temperature: 0.0 means greedy (argmax); > 0 samples from softmax(logits / t).
        top_k: keep only the k most likely tokens before sampling (0 disables).
        top_p: nucleus sampling: keep the smallest set of most likely tokens whose
            probability reaches top_p (1.0 disables).
        seed: per-request seed. Sampling is a pure function of (seed, output position), so
            a request samples the same tokens whatever else runs in its batch and whether
            its prefix came from the cache. None: the engine derives one from its own seed
            and the request id.
        stop_token_ids: generation stops after emitting one of these (finish reason
            "stop"; the stop token is included in the output). An engine with a tokenizer
            adds the tokenizer's `stop_token_ids` (eos, end of turn).
        stop: stop strings (needs an engine with a tokenizer): generation stops once the
            output text contains one (finish reason "stop"); the text ends before it.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        skip_special_tokens: leave special tokens (eos, `<|im_end|>`, ...) out of the text.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        # The one int rule (prefixcache._validate): numpy ints are ints (stored as int),
        # bools are not.
        for name in ("max_tokens", "top_k", "seed"):
            v = getattr(self, name)
            if type(v) is not int and isinstance(v, np.integer):
                object.__setattr__(self, name, int(v))
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.temperature, (int, float)) or isinstance(
                self.temperature, bool):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if (not math.isfinite(self.temperature) or self.temperature < 0
                or self.temperature > _F32_MAX):
            raise ValueError(f"temperature must be finite, >= 0 and at most {_F32_MAX:g} "
                             f"(float32), got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an int, got {self.top_k!r}")
        if not -1 <= self.top_k <= _INT32_MAX:
            raise ValueError(f"top_k must be 0 or -1 (disable), or in [1, {_INT32_MAX}] "
                             f"(int32), got {self.top_k}")
        if self.top_k == -1:
            # NOTE: vLLM accepts -1 as "disabled" too; stored as 0.
            object.__setattr__(self, "top_k", 0)
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool):
            raise ValueError(f"top_p must be a number, got {self.top_p!r}")
        if not (0.0 < self.top_p <= 1.0) or not np.float32(self.top_p) > 0:
            raise ValueError(f"top_p must be in (0, 1] and above 0 as a float32, got "
                             f"{self.top_p}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise ValueError(f"seed must be an int or None, got {self.seed!r}")
            if not 0 <= self.seed < 2**32:
                raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        stop = tuple(int(t) if isinstance(t, np.integer) and not isinstance(t, np.bool_) else t
                     for t in self.stop_token_ids)
        for t in stop:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(
                        f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stop)
        # NOTE: one stop string may be given bare, as vLLM accepts it.
        stop_strs = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        for s in stop_strs:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop_strs)
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
