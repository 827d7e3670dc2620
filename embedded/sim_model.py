"""The simulator's model: what a request asks, what it outputs and when (the scheduler).

A reply is ``<think>`` + reasoning + ``</think>`` + ``"\\n\\n"`` + answer + end-of-turn. Its length
is drawn from ``lognormal(len_mu, len_sigma)`` (median ``exp(len_mu)``) by a generator seeded with
the seed and the request's input ids, and 60-85% of the body is reasoning. Decoding stops at the
first stop id (``stop_token_ids`` or end-of-turn: finish ``stop``, ``matched`` that id) or at
max_new_tokens (finish ``length``, no end token). The reply reads the prompt as a model does: one
ending inside a think block it opened (Qwen3.5/3.6's generation prompt) gets no ``<think>``
again, and one ending right after a closed block (thinking off) gets the answer alone.

Ids come from a tokenizer directory when one is given (``<think>``, ``</think>`` and
``<|im_end|>`` are its real ids; end-of-turn falls back to the tokenizer's eos), else from the
fixed built-in table :data:`BUILTIN` (``<|im_end|>`` = 2, ``<think>`` = 3, ``</think>`` = 4).
The degenerate answer mode replies with exactly six tokens, ``thinking`` ``\\n\\n`` `` response``
``\\n`` ``OK.`` end-of-turn; under a tokenizer each piece is its longest single-token prefix.
Other faulty modes (``empty``, ``unclosed``, ``leak``: see :func:`plan_output`) exercise the
quality gates; ``--answer-mode-rate`` applies a mode to only a fraction of the prompts.
Timing: :class:`embedded.sim_scheduler.Scheduler` (formula in the docstring of
:mod:`embedded.simulator`; speculative decoding in :mod:`embedded.sim_spec`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import zlib
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

THINK, END_THINK, IM_END = "<think>", "</think>", "<|im_end|>"
SPECIALS = ("<|endoftext|>", "<|im_start|>", IM_END)
DEGENERATE = ("thinking", "\n\n", " response", "\n", "OK.")
WORDS = tuple(
    f" {w}" for w in (
        "the so we need to check first then because answer is a of and it this that let me "
        "consider value step result sum number case model token output input think again wait "
        "yes no right here now therefore which gives total count list each more less equal"
    ).split()
)
# Built-in ids are fixed: specials first (Qwen-like order), then markup, then words.
BUILTIN = (*SPECIALS, THINK, END_THINK, "\n\n", "\n", *DEGENERATE[::2], *WORDS)
BUILTIN_PROMPT_BASE = 1000  # unknown prompt words hash to ids above the built-in table


def _load_tokenizer(path: Path) -> Any:
    """A ``tokenizers.Tokenizer`` from tokenizer.json, else the fast backend of AutoTokenizer."""
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path / "tokenizer.json"))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).backend_tokenizer


class Vocab:
    """Token ids of the output structure: a tokenizer's real ids, or the fixed built-in table."""

    def __init__(self, tokenizer_path: Path | None = None) -> None:
        self.path = tokenizer_path
        self._tok = _load_tokenizer(tokenizer_path) if tokenizer_path else None
        self.think = self._encode_piece(THINK)
        self.end_think = self._encode_piece(END_THINK)
        self.nl2 = self._encode_piece("\n\n")
        self.words = [self._encode_piece(w) for w in WORDS]
        self.eot = self._end_of_turn()
        self.specials = {i for s in SPECIALS if (i := self._token_id(s)) is not None}
        # One token per piece, so the degenerate reply is exactly six tokens with any tokenizer.
        self.degenerate = [self._single_prefix(p) for p in DEGENERATE] + [self.eot]
        log.info("vocabulary %s: <think> %s, </think> %s, end-of-turn %s",
                 tokenizer_path or "built-in", self.think, self.end_think, self.eot)

    def _token_id(self, piece: str) -> int | None:
        if self._tok is None:
            return BUILTIN.index(piece) if piece in BUILTIN else None
        return self._tok.token_to_id(piece)

    def _encode_piece(self, piece: str) -> list[int]:
        single = self._token_id(piece)
        return [single] if single is not None else self.encode(piece)

    def _single_prefix(self, piece: str) -> int:
        for end in range(len(piece), 0, -1):
            ids = self._encode_piece(piece[:end])
            if len(ids) == 1:
                return ids[0]
        return self._encode_piece(piece)[0]

    def _end_of_turn(self) -> int:
        names = [IM_END, "<|eot_id|>", "<|endoftext|>", "</s>"]
        config = self.path / "tokenizer_config.json" if self.path else None
        if config and config.is_file():
            eos = json.loads(config.read_text()).get("eos_token")
            names.insert(1, eos["content"] if isinstance(eos, dict) else eos)
        for name in names:
            if isinstance(name, str) and (found := self._token_id(name)) is not None:
                return found
        raise ValueError(f"no end-of-turn token in the tokenizer at {self.path}")

    def encode(self, text: str) -> list[int]:
        """Prompt ids for the chat endpoint (built-in mode: one id per whitespace word)."""
        if self._tok is not None:
            return self._tok.encode(text, add_special_tokens=False).ids
        return [BUILTIN.index(f" {w}") if f" {w}" in BUILTIN
                else BUILTIN_PROMPT_BASE + zlib.crc32(w.encode()) % 50_000 for w in text.split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of output ids; like SGLang, special tokens are dropped unless asked for."""
        if self._tok is not None:
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        keep = [i for i in ids if not (skip_special_tokens and i in self.specials)]
        return "".join(BUILTIN[i] if 0 <= i < len(BUILTIN) else f"<{i}>" for i in keep)


def request_rng(seed: int, input_ids: list[int]) -> random.Random:
    """A generator fixed by the seed and the prompt, so the same request gives the same output."""
    digest = hashlib.blake2b(f"{seed}:{','.join(map(str, input_ids))}".encode(), digest_size=8)
    return random.Random(int.from_bytes(digest.digest(), "big"))


ANSWER_MODES = ("normal", "degenerate", "empty", "unclosed", "leak")


def plan_output(vocab: Vocab, input_ids: list[int], seed: int, mode: str, len_mu: float,
                len_sigma: float, mode_rate: float = 1.0) -> list[int]:
    """The full reply (ending with end-of-turn) that the request would get without limits.

    A non-normal ``mode`` applies to a ``mode_rate`` fraction of requests (fixed per prompt):
    ``degenerate`` six tokens; ``empty`` a closed think block and no answer; ``unclosed`` a
    think block never closed; ``leak`` a stray ``<|im_start|>`` inside the answer.
    """
    rng = request_rng(seed, input_ids)
    if mode != "normal" and rng.random() >= mode_rate:
        mode = "normal"
    if mode == "degenerate":
        return list(vocab.degenerate)
    total = max(1, round(rng.lognormvariate(len_mu, len_sigma)))
    markup = len(vocab.think) + len(vocab.end_think) + len(vocab.nl2) + 1
    body = max(2, total - markup)
    reasoning = max(1, round(body * rng.uniform(0.6, 0.85)))

    def fill(n: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            ids.extend(rng.choice(vocab.words))
        return ids[:n]

    answer = fill(body - reasoning if body > reasoning else 1)
    block = prompt_block(vocab, input_ids)
    if block == "closed":   # thinking off (an empty block pre-filled): the answer alone
        if mode == "leak":
            answer.insert(len(answer) // 2, min(vocab.specials - {vocab.eot}, default=vocab.eot))
        return [vocab.eot] if mode == "empty" else [*answer, vocab.eot]
    if block == "open":     # the template opened the block (Qwen3.5/3.6): no <think> again
        return _plan(vocab, mode, fill(reasoning), answer)[len(vocab.think):]
    return _plan(vocab, mode, fill(reasoning), answer)


def prompt_block(vocab: Vocab, input_ids: list[int]) -> str | None:
    """How the prompt leaves the think block, as a real model reads it: ``open`` when it ends
    inside one, ``closed`` when it ends right after one (thinking off), else None."""
    def last(piece: list[int]) -> int:
        n = len(piece)
        return next((i for i in range(len(input_ids) - n, -1, -1)
                     if input_ids[i:i + n] == piece), -1) if n else -1

    opened, closed = last(vocab.think), last(vocab.end_think)
    if opened > closed:
        return "open"
    tail = input_ids[closed + len(vocab.end_think):] if closed >= 0 else None
    return "closed" if tail is not None and len(tail) <= 2 * len(vocab.nl2) else None


def _plan(vocab: Vocab, mode: str, reasoning: list[int], answer: list[int]) -> list[int]:
    """A reply that opens its own think block, in ``mode``."""
    if mode == "empty":
        return [*vocab.think, *reasoning, *vocab.end_think, *vocab.nl2, vocab.eot]
    if mode == "unclosed":
        return [*vocab.think, *reasoning, *answer, vocab.eot]
    if mode == "leak":
        answer.insert(len(answer) // 2, min(vocab.specials - {vocab.eot}, default=vocab.eot))
    return [*vocab.think, *reasoning, *vocab.end_think, *vocab.nl2, *answer, vocab.eot]


def finish(full: list[int], max_new_tokens: int, stop_ids: set[int]) -> tuple[list[int], dict]:
    """Cut the reply at the first stop token or at max_new_tokens, as decoding would."""
    # The reply always ends with end-of-turn, which is always a stop id.
    stop_at = next(i for i, t in enumerate(full) if t in stop_ids or i == len(full) - 1)
    ids = full[: stop_at + 1]
    if len(ids) > max_new_tokens:
        return ids[:max_new_tokens], {"type": "length", "length": max_new_tokens}
    return ids, {"type": "stop", "matched": ids[-1]}
