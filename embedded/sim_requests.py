"""The requests the simulator refuses, as SGLang does (its status, words and limits): the body's
shape, sampling values outside ``SamplingParams.verify`` (0.5.23), and prompts too long for the
context (``tokenizer_manager.py``'s length checks). tests/test_sglang_real.py holds them to the
real server.
"""

from __future__ import annotations

from typing import Any

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default for /generate


class BadRequest(ValueError):
    """A client error, answered HTTP 400."""


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int and t >= 0 for t in value):
        raise BadRequest(f"{what} must be a list of non-negative integer token ids")
    return value


def verify_sampling(params: dict[str, Any]) -> None:
    """SGLang's own limits (``SamplingParams.verify``, 0.5.23), in its words: HTTP 400."""
    temperature = params.get("temperature", 1.0)
    top_k = params.get("top_k", -1)
    if temperature is not None and 0 <= temperature < 1e-6:
        top_k = 1   # greedy: SGLang replaces top_k before it checks it
    if temperature is not None and (temperature < 0 or temperature != temperature):
        raise BadRequest(f"temperature must be a non-negative finite number, got {temperature}.")
    top_p = params.get("top_p", 1.0)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}.")
    min_p = params.get("min_p", 0.0)
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise BadRequest(f"min_p must be in [0, 1], got {min_p}.")
    if top_k is not None and top_k != -1 and top_k < 1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    for name in ("frequency_penalty", "presence_penalty"):
        value = params.get(name, 0.0)
        if value is not None and not -2.0 <= value <= 2.0:
            raise BadRequest(f"{name} must be in [-2, 2], got {value}.")
    penalty = params.get("repetition_penalty", 1.0)
    if penalty is not None and not 0.0 < penalty <= 2.0:
        raise BadRequest("repetition_penalty must be in (0, 2] (1.0 = no penalty), "
                         f"got {penalty}.")


def parse_sampling(params: Any) -> tuple[int, set[int], bool]:
    """(max_new_tokens, stop ids, skip_special_tokens) of one request's sampling_params."""
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object (or a list of objects for a batch)")
    max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if type(max_new) is not int or max_new < 0:
        raise BadRequest("max_new_tokens must be a non-negative integer")
    for name in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                 "presence_penalty", "repetition_penalty"):
        if params.get(name) is not None and not isinstance(params[name], int | float):
            raise BadRequest(f"{name} must be a number")
    verify_sampling(params)
    stops = set(_int_list(params.get("stop_token_ids") or [], "stop_token_ids"))
    return max_new, stops, bool(params.get("skip_special_tokens", True))


def check_context(prompt: int, max_new: int, context: int) -> None:
    """SGLang's length checks, in its words: a prompt of ``max_req_input_len`` (its context
    less 6) or more, or prompt plus ``max_new_tokens`` beyond the context, is HTTP 400."""
    max_input = context - 6
    if prompt >= max_input:
        raise BadRequest(f"Input length ({prompt} tokens) exceeds the maximum allowed length "
                         f"({max_input} tokens). Use a shorter input or enable "
                         "--allow-auto-truncate.")
    if prompt + max_new > context:
        raise BadRequest(f"Requested token count exceeds the model's maximum context length of "
                         f"{context} tokens. You requested a total of {prompt + max_new} "
                         f"tokens: {prompt} tokens from the input messages and {max_new} "
                         "tokens for the completion. Please reduce the number of tokens in "
                         "the input messages or the completion to fit within the limit.")


def parse_generate(body: Any) -> tuple[list[list[int]], list[Any], list[Any], bool]:
    """(prompts, sampling params, rids, is_batch) of a /generate body, or BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the simulator")
    ids = body.get("input_ids")
    if ids is None:
        raise BadRequest("input_ids is required (the simulator does not tokenize text)")
    batch = isinstance(ids, list) and bool(ids) and all(isinstance(p, list) for p in ids)
    prompts = ids if batch else [ids]
    for prompt in prompts:
        if not _int_list(prompt, "input_ids"):
            raise BadRequest("input_ids must not be empty")
    params = body.get("sampling_params") or {}
    params = params if isinstance(params, list) else [params] * len(prompts)
    rids = body.get("rid")
    rids = rids if isinstance(rids, list) else [rids] * len(prompts)
    if len(params) != len(prompts) or len(rids) != len(prompts):
        raise BadRequest("sampling_params and rid lists must match the batch size")
    if batch and isinstance(body.get("rid"), str):
        raise BadRequest("a batch needs a list of rids")
    return prompts, [parse_sampling(p) for p in params], rids, batch
