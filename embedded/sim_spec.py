"""Speculative decoding in the simulator: SGLang's NEXTN/EAGLE chain (top-1), modelled.

SGLang's flags are taken as it takes them: ``--speculative-algorithm NEXTN`` (reported as
``EAGLE``, SGLang's resolved name, in ``/get_server_info``), ``--speculative-num-steps S``
(default 3), ``--speculative-eagle-topk`` (1: a chain) and ``--speculative-num-draft-tokens``
(with top-1 always ``S + 1``, as SGLang adjusts it). ``DFLASH`` (with
``--speculative-draft-model-path``, logged) verifies a block of
``--speculative-num-draft-tokens`` (16): ``S`` is the block less one, drafted in one forward of
``--draft-step-ms``. ``--accept-length A`` is the mean tokens a verify step emits (1 to S + 1):
each draft is accepted with the probability ``p`` that makes ``1 + p + ... + p^S = A``, drawn
per request by a generator fixed by the seed and its prompt, so the same request gets the same
figures. The tokens are committed through a real draft and verify step (:meth:`SpecModel.step`):
the draft proposes ``S`` tokens, each the target's own next token with probability ``p`` and a
wrong one otherwise; the verify accepts the drafts up to the first that differs from the
target's sequence (the plain decode's ids) and adds the target's own token there. So the output
equals the plain decode's exactly when the verify is right: ``--verify-fault accept-all`` (tests
only) commits every draft, wrong ones included, and the output differs. A request's first token
comes from its prefill; every later step is a verify step. Time
(:class:`embedded.sim_scheduler.LatencyModel`): a step verifies ``S + 1`` tokens per request, so
its ``decode_per_req_ms`` part grows with them, and the draft model's ``S`` forward passes add
``S x --draft-step-ms``: at a small, memory-bound batch the fixed ``decode_base_ms`` dominates
and a step's ``A`` tokens are nearly free; at a large, compute-bound batch the verified tokens
dominate and MTP loses (``A < S + 1``).

Each answer's ``meta_info`` carries SGLang's ``spec_*`` figures (``spec_verify_ct``,
``spec_accept_length``, ``spec_accept_rate``, ``spec_num_correct_drafts``,
``spec_num_proposed_drafts``, ``spec_correct_drafts_histogram``) when it had a verify step.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from functools import cached_property
from typing import Any

ALGORITHMS = {"NEXTN": "EAGLE", "EAGLE": "EAGLE",   # what SGLang resolves them to
              "DFLASH": "DFLASH"}   # a block of --speculative-num-draft-tokens, S = block - 1
DEFAULT_STEPS = 3
SPEC_MAX_RUNNING = 48   # SGLang's cap on a speculative server without --max-running-requests


def acceptance_probability(accept_length: float, drafts: int) -> float:
    """The per-draft ``p`` with ``1 + p + ... + p^drafts = accept_length`` (bisection)."""
    if accept_length >= drafts + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(drafts + 1)) < accept_length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True)
class SpecModel:
    """A chain of ``steps`` drafts, ``steps + 1`` tokens verified per request and step."""

    algorithm: str
    steps: int
    topk: int
    accept_length: float
    draft_step_ms: float

    @property
    def draft_tokens(self) -> int:
        return self.steps + 1

    @property
    def draft_forwards(self) -> int:
        """Draft forwards per step: DFLASH fills its block in one, a chain takes one a draft."""
        return 1 if self.algorithm == "DFLASH" else self.steps

    @cached_property
    def p(self) -> float:
        return acceptance_probability(self.accept_length, self.steps)

    verify_fault: str = "none"

    def draft(self, rng: random.Random, target: list[int], at: int) -> list[int]:
        """The draft's ``steps`` tokens after position ``at``: the target's own with probability
        ``p`` each, else a wrong one (past the target's end: its last token, repeated)."""
        out = []
        for i in range(self.steps):
            truth = target[min(at + i, len(target) - 1)]
            out.append(truth if rng.random() < self.p else (truth - 1 if truth > 0 else 1))
        return out

    def verify(self, drafts: list[int], target: list[int], at: int) -> list[int]:
        """What one verify step commits: the drafts up to the first that is not the target's
        token, then the target's own token there (SGLang's chain verify, greedy)."""
        accepted = 0
        while (accepted < len(drafts) and at + accepted < len(target)
               and (drafts[accepted] == target[at + accepted]
                    or self.verify_fault == "accept-all")):
            accepted += 1
        bonus = target[at + accepted: at + accepted + 1]
        return drafts[:accepted] + bonus

    def step(self, rng: random.Random, target: list[int], at: int) -> list[int]:
        """One draft-and-verify step at position ``at`` of the target's sequence."""
        return self.verify(self.draft(rng, target, at), target, at)

    def server_info(self) -> dict[str, Any]:
        return {"speculative_algorithm": self.algorithm, "speculative_num_steps": self.steps,
                "speculative_eagle_topk": self.topk,
                "speculative_num_draft_tokens": self.draft_tokens}


@dataclass
class SpecCounts:
    """One request's verify steps, as SGLang counts them."""

    verify_ct: int = 0
    correct: int = 0
    histogram: list[int] | None = None

    def add(self, emitted: int, drafts: int) -> None:
        self.verify_ct += 1
        self.correct += emitted - 1
        self.histogram = self.histogram or [0] * (drafts + 1)
        self.histogram[emitted - 1] += 1

    def meta_info(self, completion_tokens: int, drafts: int) -> dict[str, Any]:
        """SGLang's ``spec_*`` fields (none before a verify step, as SGLang)."""
        if not self.verify_ct:
            return {}
        proposed = self.verify_ct * drafts
        return {"spec_verify_ct": self.verify_ct,
                "spec_accept_length": completion_tokens / self.verify_ct,
                "spec_accept_rate": self.correct / proposed if proposed else 0.0,
                "spec_num_correct_drafts": self.correct,
                "spec_num_proposed_drafts": proposed,
                "spec_correct_drafts_histogram": list(self.histogram or [])}


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """SGLang's speculative flags the simulator honours, and its own knobs."""
    group.add_argument("--speculative-algorithm", help="NEXTN (or EAGLE): a chain of drafts")
    group.add_argument("--speculative-num-steps", type=int)
    group.add_argument("--speculative-eagle-topk", type=int)
    group.add_argument("--speculative-num-draft-tokens", type=int)
    group.add_argument("--speculative-draft-model-path", help="DFLASH's drafter (logged)")
    group.add_argument("--accept-length", type=float, default=2.5,
                       help="mean tokens a verify step emits (1 to steps + 1)")
    group.add_argument("--draft-step-ms", type=float, default=0.2,
                       help="one forward of the draft (MTP) head")
    group.add_argument("--verify-fault", choices=("none", "accept-all"), default="none",
                       help="tests only: a broken verify that commits every draft")


def spec_model(args: argparse.Namespace) -> SpecModel | None:
    """The model the flags ask for; ValueError (SGLang's or ours) for what cannot run."""
    algorithm = args.speculative_algorithm
    if algorithm is None:
        return None
    if algorithm.upper() not in ALGORITHMS:
        raise ValueError(f"--speculative-algorithm {algorithm}: the simulator models NEXTN "
                         "and EAGLE (a chain of drafts), and DFLASH (a block)")
    steps = args.speculative_num_steps or DEFAULT_STEPS
    if algorithm.upper() == "DFLASH":   # one drafter forward fills the block's B - 1 drafts
        steps = (args.speculative_num_draft_tokens or 16) - 1
    topk = args.speculative_eagle_topk or 1
    if steps < 1 or topk != 1:
        raise ValueError("the simulator models a chain: --speculative-num-steps >= 1, "
                         "--speculative-eagle-topk 1")
    if not 1 <= args.accept_length <= steps + 1 or args.draft_step_ms < 0:
        raise ValueError(f"--accept-length must be within 1 and {steps + 1} (steps + 1), "
                         "--draft-step-ms >= 0")
    return SpecModel(ALGORITHMS[algorithm.upper()], steps, topk, args.accept_length,
                     args.draft_step_ms, args.verify_fault)
