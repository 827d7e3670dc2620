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

from typing_extensions import TypedDict  # pydantic reads it on Python 3.11

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


class SpeculativeFigures(TypedDict):
    """One worker's speculative decoding on a run (``status``'s ``speculative``)."""

    algorithm: str | None
    verify_steps: int
    output_tokens: int
    accept_length: float | None


class MtpRates(TypedDict):
    on: float    # tok/s measured with the MTP head
    off: float


class MtpChoice(TypedDict):
    """One worker's MTP choice on a run (``status``'s ``mtp``), as the worker recorded it."""

    mtp: str
    mode: str
    reason: str
    source: MtpSource | None   # None: a record of a worker before sources, or foreign
    rates: MtpRates | None     # the measurement followed, if any


def by_worker(raw: Mapping[str, str], key: str = "speculative figures"
              ) -> dict[str, SpeculativeFigures]:
    """A run's Redis hash of figures (``key``: where it was read) as ``{worker: {algorithm,
    accept_length, verify_steps, output_tokens}}``; a count that is none is noted and 0."""
    algorithms: dict[str, str] = {}
    counts: dict[str, dict[str, int]] = {}
    for name, value in raw.items():
        what, _, worker = name.partition(":")
        if what not in (ALGORITHM, STEPS, TOKENS) or not worker:
            continue
        entry = counts.setdefault(worker, {STEPS: 0, TOKENS: 0})
        if what == ALGORITHM:
            algorithms[worker] = value
        else:
            entry[what] = _count(f"{key}[{name[:80]}]", value)
    return {worker: {"algorithm": algorithms.get(worker), "verify_steps": entry[STEPS],
                     "output_tokens": entry[TOKENS],
                     "accept_length": accept_length(entry[TOKENS], entry[STEPS])}
            for worker, entry in sorted(counts.items())}


def _count(where: str, value: str) -> int:
    """A figure's count (Redis text); 0 where it is none, noted (``where``: its hash field)."""
    if value.isascii() and value.isdigit() and len(value) <= 18:
        return int(value)
    note(ForeignObject(where, f"not a count: {value[:40]!r}"))
    return 0


def choices_by_worker(raw: Mapping[str, str]) -> dict[str, MtpChoice]:
    """A run's Redis hash of MTP choices (:attr:`common.queue.redis_keys.RunKeys.mtp`) as
    ``{worker: {mtp, mode, reason, source, rates}}`` (``rates``: ``{"on", "off"}`` tok/s of
    the measurement followed, else None); malformed entries left out."""
    found: dict[str, MtpChoice] = {}
    sources = {source.value: source for source in MtpSource}
    for worker, value in sorted(raw.items()):
        try:
            entry = parse_json(f"dflash:generate:mtp:{worker}", value)
        except ForeignObject as exc:
            note(exc)
            continue
        if isinstance(entry, dict):
            source = entry.get("source")   # a record of a worker before sources: null
            found[worker] = {
                "mtp": str(entry.get("mtp", "")), "mode": str(entry.get("mode", "")),
                "reason": str(entry.get("reason", "")),
                "source": sources.get(source) if isinstance(source, str) else None,
                "rates": _rates(entry.get("rates"))}
    return found


def _rates(value: object) -> MtpRates | None:
    """``{"on": tok/s, "off": tok/s}`` where both are numbers, else None."""
    if not isinstance(value, dict):
        return None
    on, off = _rate(value.get("on")), _rate(value.get("off"))
    return {"on": on, "off": off} if on is not None and off is not None else None


def _rate(value: object) -> float | None:
    """A rate that is a number of at least 0 (a bool is none), else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return None
