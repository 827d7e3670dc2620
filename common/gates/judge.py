"""Per-sample quality gates: judge each regenerated turn before it can reach training.

The thresholds are a :class:`GateConfig` frozen into ``run.json``. Each turn is inspected from
its exact token ids (:func:`inspect_turn`), then :func:`judge` turns the facts of a sample's
turns into its ``quality`` record: ``passed``, reason codes, human details, supervised and
thinking token counts per turn, and an answer hash for the run-wide duplicate check (done by
the run monitor, which sees every worker's samples).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from common.choices import FinishReason, Reason

THINK, END_THINK = "<think>", "</think>"
# Template markers that must never appear as text inside an answer.
MARKERS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", THINK, END_THINK)


# ``enqueue --skip-gate NAME``: the per-sample gate NAME turns off, as this GateConfig field.
SKIPPABLE_GATES = {"truncated": "reject_truncated", "thinking": "require_thinking",
                   "empty_answer": "reject_empty_answer", "leakage": "reject_leakage",
                   "duplicates": "reject_duplicates"}


@dataclass(frozen=True)
class GateConfig:
    """Gate thresholds; ``min_supervised_tokens`` defaults to 2 x the DFlash block size (16)."""

    min_supervised_tokens: int = 32
    reject_truncated: bool = True
    require_thinking: bool = True
    reject_empty_answer: bool = True
    reject_leakage: bool = True
    reject_duplicates: bool = True
    max_reject_rate: float = 0.2
    pause_after: int = 200
    min_answer_tokens: int = 256

    def __post_init__(self) -> None:
        if not 0 <= self.max_reject_rate <= 1:
            raise ValueError(f"max_reject_rate must be within [0, 1], not {self.max_reject_rate}")
        if self.pause_after < 1 or self.min_supervised_tokens < 0 or self.min_answer_tokens < 0:
            raise ValueError("pause_after must be >= 1 and token floors >= 0")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> GateConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in known})


@dataclass(frozen=True)
class TokenInfo:
    """What the gates need to know about a tokenizer: its special ids and the think markers."""

    specials: frozenset[int]
    think_open: int | None
    think_close: int | None
    special_texts: tuple[str, ...] = ()  # special tokens other than the think markers

    @classmethod
    def of(cls, tokenizer: Any) -> TokenInfo:
        vocab = tokenizer.get_vocab()
        texts = tuple(t for t in tokenizer.all_special_tokens if t not in (THINK, END_THINK))
        return cls(frozenset(tokenizer.all_special_ids), vocab.get(THINK), vocab.get(END_THINK),
                   texts)


@dataclass(frozen=True, slots=True)
class TurnFacts:
    """What one generated turn looks like, read from its ids and its decoded text."""

    finish_reason: FinishReason
    output_tokens: int
    thinking_tokens: int
    opened: bool
    closed: bool
    answer: str
    leaked: str | None


def _last(ids: Sequence[int], token: int | None) -> int:
    if token is None:
        return -1
    for index in range(len(ids) - 1, -1, -1):
        if ids[index] == token:
            return index
    return -1


def opened_by_prompt(info: TokenInfo, prompt_ids: Sequence[int]) -> bool:
    """The prompt ends inside a think block it opened (its last ``<think>`` is unclosed), as
    Qwen3.5/3.6's generation prompt does with thinking on (:mod:`common.gates.reasoning`)."""
    opened = _last(prompt_ids, info.think_open)
    return opened >= 0 and opened > _last(prompt_ids, info.think_close)


def inspect_turn(info: TokenInfo, prompt_ids: list[int], output_ids: list[int], text: str,
                 answer: str, finish_reason: str) -> TurnFacts:
    """Facts of a turn; ``text`` is the output decoded with special tokens kept."""
    prefilled = opened_by_prompt(info, prompt_ids)
    opened = prefilled or THINK in text
    closed = END_THINK in text
    finish = FinishReason.parse(finish_reason)   # an engine's or a stored sample's text
    return TurnFacts(finish, len(output_ids), _thinking_tokens(info, output_ids, prefilled),
                     opened, closed, answer, _leak(info, output_ids, text, finish))


def _thinking_tokens(info: TokenInfo, ids: list[int], prefilled: bool) -> int:
    start = 0 if prefilled else (ids.index(info.think_open) + 1
                                 if info.think_open in ids else None)
    if start is None:
        return 0
    end = ids.index(info.think_close, start) if info.think_close in ids[start:] else len(ids)
    return end - start


def _leak(info: TokenInfo, ids: list[int], text: str,
          finish_reason: FinishReason) -> str | None:
    """The first stray special token or template marker, if any."""
    ends_on_stop = finish_reason is FinishReason.STOP and ids and ids[-1] in info.specials
    body = ids[:-1] if ends_on_stop else ids
    if not info.specials.isdisjoint(body):
        stray = next(t for t in body if t in info.specials)
        return f"special token id {stray} inside the output"
    for marker in MARKERS:
        count = text.count(marker)
        allowed = 1 if marker in (THINK, END_THINK) else 0
        if marker not in (THINK, END_THINK) and finish_reason is FinishReason.STOP \
                and text.rstrip().endswith(marker):
            allowed = 1
        if count > allowed:
            return f"{marker!r} appears {count} times"
    return None


def answer_hash(answers: list[str]) -> str:
    """A short fingerprint of a sample's answers, whitespace-normalized, for duplicate checks."""
    text = "\x1e".join(" ".join(a.split()) for a in answers)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def judge(turns: list[TurnFacts], gates: GateConfig, thinking: bool,
          first: int = 1) -> dict[str, Any]:
    """The verdict on turns numbered from ``first``; every failing gate is listed, per turn."""
    found: list[tuple[Reason, str]] = []
    for index, turn in enumerate(turns):
        where = f"turn {index + first}"
        if gates.reject_truncated and turn.finish_reason is not FinishReason.STOP:
            found.append((Reason.TRUNCATED, f"{where}: finish_reason {turn.finish_reason} "
                                            f"after {turn.output_tokens} tokens"))
        unclosed = thinking and turn.opened and not turn.closed
        if thinking and gates.require_thinking and not turn.opened and not turn.closed:
            found.append((Reason.THINKING_MISSING, f"{where}: no {THINK} block"))
        elif unclosed and gates.require_thinking:
            found.append((Reason.THINKING_UNCLOSED, f"{where}: {THINK} never closed"))
        # An unclosed block is all reasoning: its missing answer is not a separate fault.
        if gates.reject_empty_answer and not unclosed and not turn.answer.strip():
            found.append((Reason.EMPTY_ANSWER, f"{where}: empty answer"))
        if turn.output_tokens < gates.min_supervised_tokens:
            found.append((Reason.TOO_FEW_TOKENS, f"{where}: {turn.output_tokens} supervised "
                                                 f"tokens < {gates.min_supervised_tokens}"))
        if gates.reject_leakage and (THINK in turn.answer or END_THINK in turn.answer):
            found.append((Reason.THINK_IN_ANSWER, f"{where}: a think marker inside the answer"))
        elif gates.reject_leakage and turn.leaked:
            found.append((Reason.TEMPLATE_LEAKAGE, f"{where}: {turn.leaked}"))
    reasons = list(dict.fromkeys(reason.value for reason, _ in found))
    return {
        "passed": not found,
        "reasons": reasons,
        "details": [detail for _, detail in found],
        "supervised_tokens": [t.output_tokens for t in turns],
        "thinking_tokens": [t.thinking_tokens for t in turns],
        "answer_hash": answer_hash([t.answer for t in turns]),
    }


def mark_duplicate(quality: dict[str, Any], first_id: str) -> None:
    """Reject a sample whose answers exactly repeat an earlier sample's."""
    if Reason.DUPLICATE.value not in quality["reasons"]:
        quality["reasons"].append(Reason.DUPLICATE.value)
        quality["details"].append(f"same answer as sample {first_id}")
    quality["passed"] = False
