"""The engine's speculative-decoding figures: per stored turn, per worker, per run.

SGLang 0.5.23 adds to a request's ``meta_info`` (``srt/managers/tokenizer_manager.py``,
``_calculate_spec_decoding_metrics``), only when the request had a verify step:
``spec_verify_ct`` (verify steps), ``spec_accept_length`` (``completion_tokens / spec_verify_ct``:
tokens per step, the bonus token included), ``spec_accept_rate`` (correct / proposed drafts),
``spec_num_correct_drafts``, ``spec_num_proposed_drafts`` (``verify_ct x (draft_tokens - 1)``)
and, when non-empty, ``spec_correct_drafts_histogram`` (steps by drafts accepted) and a few
block/cap figures. Each stored turn keeps them as given (``turns[i].speculative``); a worker
adds its turns' verify steps and tokens up per run in Redis, and ``status`` shows each worker's
algorithm and mean accept length (total tokens / total verify steps, SGLang's own ratio).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from common.choices import MtpSource
from common.errors import ForeignObject
from common.reads import note, parse_json

SPEC_PREFIX = "spec_"
VERIFY_CT = "spec_verify_ct"
# Redis hash fields of a run's figures (common.queue.redis_keys.RunKeys.speculative):
# "<what>:<worker>".
ALGORITHM, STEPS, TOKENS = "algorithm", "verify_steps", "output_tokens"


def spec_figures(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``spec_*`` fields of a ``/generate`` answer's ``meta_info``; None without them."""
    figures = {k: v for k, v in meta.items() if k.startswith(SPEC_PREFIX)}
    return figures or None


def server_algorithm(server_info: Any) -> str | None:
    """The speculative algorithm a server reports in ``/get_server_info`` (SGLang resolves
    NEXTN to EAGLE there), or None."""
    algorithm = server_info.get("speculative_algorithm") if isinstance(server_info, dict) \
        else None
    return algorithm if isinstance(algorithm, str) and algorithm else None


def sample_totals(samples: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
    """(verify steps, output tokens) of the stored turns that were verified in steps."""
    steps = tokens = 0
    for sample in samples:
        for turn in sample.get("turns", ()):
            verify = (turn.get("speculative") or {}).get(VERIFY_CT)
            if isinstance(verify, int) and verify > 0:
                steps += verify
                tokens += int(turn.get("completion_tokens", 0))
    return steps, tokens


def accept_length(tokens: int, steps: int) -> float | None:
    """Mean tokens per verify step, as SGLang defines it; None before any step."""
    return round(tokens / steps, 3) if steps else None


def field(what: str, worker: str) -> str:
    return f"{what}:{worker}"


def by_worker(raw: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """A run's Redis hash of figures as ``{worker: {algorithm, accept_length, verify_steps,
    output_tokens}}``."""
    workers: dict[str, dict[str, Any]] = {}
    for name, value in raw.items():
        what, _, worker = name.partition(":")
        if what not in (ALGORITHM, STEPS, TOKENS) or not worker:
            continue
        entry = workers.setdefault(worker, {ALGORITHM: None, STEPS: 0, TOKENS: 0})
        entry[what] = value if what == ALGORITHM else int(value)
    for entry in workers.values():
        entry["accept_length"] = accept_length(entry[TOKENS], entry[STEPS])
    return dict(sorted(workers.items()))


def choices_by_worker(raw: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """A run's Redis hash of MTP choices (:attr:`common.queue.redis_keys.RunKeys.mtp`) as
    ``{worker: {mtp, mode, reason, source, rates}}`` (``rates``: ``{"on", "off"}`` tok/s of
    the measurement followed, else None); malformed entries left out."""
    found: dict[str, dict[str, Any]] = {}
    for worker, value in sorted(raw.items()):
        try:
            entry = parse_json(f"dflash:generate:mtp:{worker}", value)
        except ForeignObject as exc:
            note(exc)
            continue
        if isinstance(entry, dict):
            found[worker] = {k: str(entry.get(k, "")) for k in ("mtp", "mode", "reason")}
            source = entry.get("source")   # a record of a worker before sources: null
            found[worker]["source"] = source if source in set(MtpSource) else None
            found[worker]["rates"] = _rates(entry.get("rates"))
    return found


def _rates(value: Any) -> dict[str, float] | None:
    """``{"on": tok/s, "off": tok/s}`` where both are numbers, else None."""
    if not isinstance(value, dict):
        return None
    rates = {k: value.get(k) for k in ("on", "off")}
    if not all(isinstance(r, int | float) and not isinstance(r, bool) and r >= 0
               for r in rates.values()):
        return None
    return {k: float(r) for k, r in rates.items() if r is not None}

