"""Greedy DFlash speculative decoding as SGLang serves it, to measure the acceptance length tau.

    proposer = DFlashProposer(drafter)                       # or any Proposer (tests: an oracle)
    out = speculative_generate(target, proposer, prompt_ids, layer_ids, 512, stop_ids)
    assert out.tokens == greedy_generate(target, prompt_ids, 512, stop_ids).tokens   # lossless
    stats = AcceptanceStats.of([out, ...], proposer.block_size)     # tau, histogram, per position

The target prefills the prompt into its cache (HF ``DynamicCache``; a hybrid target's also holds
its linear-attention layers' conv and recurrent state) and keeps its DFlash layers' features.
Each step the proposer fills the block ``[last token, MASK x (B-1)]`` from the context
features, the target verifies the block in one forward over its cache, the longest draft prefix
equal to the target's own greedy choices is accepted plus the target's next token, the cache is
rolled back to the accepted tokens (:mod:`workers.train.drafter.target_cache`: a crop for
attention layers, a state rollback for linear-attention ones) and their features extend the
drafter's context. A step's acceptance length counts the accepted drafts plus one, before any
cut at a stop token or the token budget, as SGLang's ``spec_accept_length`` does.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from workers.capture import LayerCapture
from workers.target_heads import target_device
from workers.train.drafter.model import ContextCache, DFlashDraftModel
from workers.train.drafter.target_cache import (
    DEFAULT_ROLLBACK,
    TargetCache,
    new_cache,
    target_forward,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class Decoded:
    """One prompt's generated tokens and, for speculative decoding, each verify step's yield."""

    tokens: list[int]                         # stop token included, at most the budget
    target_forwards: int                      # the prefill and every verify (or decode) step
    accepted: list[int] = field(default_factory=list)   # per verify step: drafts accepted + 1


class Proposer(Protocol):
    """What proposes a block's ``B - 1`` draft tokens for the target to verify."""

    block_size: int

    def begin(self) -> None:
        """Forget the previous sequence."""

    def propose(self, sequence: list[int], new_features: torch.Tensor) -> torch.Tensor:
        """Drafts ``[B-1]`` after ``sequence`` (its last token is the block's anchor), given the
        target features ``[n, K*H]`` of the tokens accepted since the last call."""


class DFlashProposer:
    """A DFlash drafter filling ``[anchor, MASK x (B-1)]`` in one forward over its context."""

    def __init__(self, drafter: DFlashDraftModel, block_size: int | None = None) -> None:
        self.drafter = drafter.eval()
        self.block_size = block_size or drafter.config.block_size
        if self.block_size < 2:
            raise ValueError(f"block size must be at least 2, not {self.block_size}")
        self.cache = ContextCache()

    def begin(self) -> None:
        self.cache = ContextCache()

    @torch.no_grad()
    def propose(self, sequence: list[int], new_features: torch.Tensor) -> torch.Tensor:
        device = self.drafter.fc.weight.device
        anchor, count = len(sequence) - 1, new_features.shape[0]
        block = torch.full((1, self.block_size), self.drafter.config.mask_token_id,
                           dtype=torch.long, device=device)
        block[0, 0] = sequence[-1]
        positions = torch.arange(anchor, anchor + self.block_size, device=device)[None]
        context_positions = torch.arange(anchor - count, anchor, device=device)[None]
        # As in training: bf16 autocast on CUDA for a float32 drafter.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            hidden = self.drafter(block, positions, new_features[None].to(device),
                                  context_positions, None, cache=self.cache)
            return self.drafter.logits(hidden[0, 1:]).argmax(-1)


def _device(target: PreTrainedModel) -> torch.device:
    return target_device(target)


def _ended(tokens: list[int], budget: int, stop_ids: set[int]) -> bool:
    return len(tokens) >= budget or tokens[-1] in stop_ids


def _prompt(target: PreTrainedModel, prompt_ids: list[int]) -> torch.Tensor:
    return torch.tensor([prompt_ids], dtype=torch.long, device=_device(target))


@torch.no_grad()
def greedy_generate(target: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int,
                    stop_ids: Iterable[int]) -> Decoded:
    """Plain greedy decoding of the target, one token per forward over its cache."""
    stops = set(stop_ids)
    cache = new_cache(target)
    out = target_forward(target, _prompt(target, prompt_ids), cache, logits_to_keep=1)
    tokens, forwards = [int(out.logits[0, -1].argmax())], 1
    while not _ended(tokens, max_new_tokens, stops):
        step = torch.tensor([[tokens[-1]]], dtype=torch.long, device=_device(target))
        out = target_forward(target, step, cache)
        tokens.append(int(out.logits[0, -1].argmax()))
        forwards += 1
    return Decoded(tokens, forwards)


@torch.no_grad()
def speculative_generate(target: PreTrainedModel, proposer: Proposer, prompt_ids: list[int],
                         layer_ids: Sequence[int], max_new_tokens: int,
                         stop_ids: Iterable[int], rollback: str = DEFAULT_ROLLBACK) -> Decoded:
    """Greedy speculative decoding: the target's own greedy output, in fewer target forwards.

    ``rollback`` picks how a hybrid target's linear-attention state returns to the accepted
    prefix (:mod:`workers.train.drafter.target_cache`); a dense target ignores it."""
    stops = set(stop_ids)
    cache = TargetCache.for_target(target, rollback)
    capture = LayerCapture(target, layer_ids)   # the K layers, never every layer's states
    out, features = capture.during(
        lambda: cache.forward(_prompt(target, prompt_ids), logits_to_keep=1))
    tokens = [int(out.logits[0, -1].argmax())]
    sequence = list(prompt_ids) + tokens
    features = features[0]
    accepted, forwards = [], 1
    proposer.begin()
    while not _ended(tokens, max_new_tokens, stops):
        drafts = proposer.propose(sequence, features).to(_device(target))
        block = torch.cat([torch.tensor([tokens[-1]], device=drafts.device), drafts])
        out, verified = capture.during(functools.partial(cache.verify, block[None]))
        forwards += 1
        choices = out.logits[0].argmax(-1)
        n = int((block[1:] == choices[:-1]).cumprod(0).sum())
        accepted.append(n + 1)
        # The anchor and the n accepted drafts stay in the cache; the rest was speculation.
        cache.keep(n + 1, len(sequence) + n)
        features = verified[0, : n + 1]
        for token in block[1:n + 1].tolist() + [int(choices[n])]:
            tokens.append(token)
            sequence.append(token)
            if _ended(tokens, max_new_tokens, stops):
                break
    return Decoded(tokens, forwards, accepted)


@dataclass(frozen=True)
class AcceptanceStats:
    """Acceptance over many prompts: tau per prompt and pooled, histogram, per-position rates."""

    block_size: int
    prompts: int
    tokens: int
    steps: int
    tau: float                   # mean over prompts of the prompt's mean acceptance length
    tau_pooled: float            # every verify step of every prompt weighted alike
    accepted_hist: dict[str, int]   # acceptance length (1..B) -> verify steps
    per_position: list[float]    # draft k = 1..B-1 accepted, given drafts 1..k-1 were
    target_forwards_per_token: float

    @classmethod
    def of(cls, results: Sequence[Decoded], block_size: int) -> AcceptanceStats:
        steps = [a for r in results for a in r.accepted]
        per_prompt = [sum(r.accepted) / len(r.accepted) for r in results if r.accepted]
        hist = {str(k): 0 for k in range(1, block_size + 1)}
        reached, passed = [0] * block_size, [0] * block_size
        for length in steps:
            hist[str(min(length, block_size))] += 1
            for k in range(1, block_size):
                reached[k] += length >= k          # drafts 1..k-1 were accepted
                passed[k] += length >= k + 1
        tokens = sum(len(r.tokens) for r in results)
        return cls(
            block_size=block_size, prompts=len(results), tokens=tokens, steps=len(steps),
            tau=sum(per_prompt) / len(per_prompt) if per_prompt else 0.0,
            tau_pooled=sum(steps) / len(steps) if steps else 0.0, accepted_hist=hist,
            per_position=[passed[k] / reached[k] if reached[k] else 0.0
                          for k in range(1, block_size)],
            target_forwards_per_token=(sum(r.target_forwards for r in results) / tokens
                                       if tokens else 0.0),
        )

    def to_json(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "prompts": self.prompts, "tokens": self.tokens,
                "steps": self.steps, "tau": round(self.tau, 4),
                "tau_pooled": round(self.tau_pooled, 4), "accepted_hist": self.accepted_hist,
                "per_position": [round(p, 4) for p in self.per_position],
                "target_forwards_per_token": round(self.target_forwards_per_token, 4)}
