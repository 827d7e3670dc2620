"""The sampling values the pinned SGLang accepts, checked at enqueue so no request gets a 400.

SGLang's own ``SamplingParams`` verification is used where SGLang is importable (a GPU host's
``.[gpu]`` install); elsewhere the same limits, read from its ``sampling_params.py`` (0.5.23):
temperature finite and >= 0, top_p in (0, 1], top_k -1 or >= 1 (any value when greedy: SGLang
replaces it with 1), max_new_tokens >= 0.
"""

from __future__ import annotations

import math

from common.engine.sampling import Sampling
from common.errors import OptionRefused

_GREEDY_BELOW = 1e-6   # SGLang's _SAMPLING_EPS: a temperature under it is greedy decoding


def check_sampling(sampling: Sampling) -> None:
    """Raise :class:`OptionRefused` naming the option SGLang would refuse, else return."""
    problem = _sglang_says(sampling) or _limits_say(sampling)
    if problem:
        raise OptionRefused(f"{problem} (SGLang refuses it: every request would get HTTP 400)")


def _limits_say(sampling: Sampling) -> str | None:
    if not math.isfinite(sampling.temperature) or sampling.temperature < 0:
        return f"--temperature {sampling.temperature}: must be a non-negative finite number"
    if not 0.0 < sampling.top_p <= 1.0:
        return f"--top-p {sampling.top_p}: must be in (0, 1]"
    greedy = sampling.temperature < _GREEDY_BELOW
    if not greedy and sampling.top_k != -1 and sampling.top_k < 1:
        return f"--top-k {sampling.top_k}: must be -1 (off) or at least 1"
    if sampling.max_new_tokens < 0:
        return f"--max-new-tokens {sampling.max_new_tokens}: must be at least 0"
    if not 0.0 <= sampling.min_p <= 1.0:
        return f"min_p {sampling.min_p}: must be in [0, 1]"
    if not 0.0 < sampling.repetition_penalty <= 2.0:
        return f"repetition_penalty {sampling.repetition_penalty}: must be in (0, 2]"
    if not -2.0 <= sampling.presence_penalty <= 2.0:
        return f"presence_penalty {sampling.presence_penalty}: must be in [-2, 2]"
    return None


def _sglang_says(sampling: Sampling) -> str | None:
    try:
        from sglang.srt.sampling.sampling_params import SamplingParams
    except ImportError:   # the CPU install: the limits above are SGLang's
        return None
    try:
        SamplingParams(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                       top_p=sampling.top_p, top_k=sampling.top_k, min_p=sampling.min_p,
                       repetition_penalty=sampling.repetition_penalty,
                       presence_penalty=sampling.presence_penalty).verify(vocab_size=2**31)
    except (ValueError, TypeError) as exc:
        return f"sampling: {exc}"
    return None
