"""Speculative decoding on the tiny CPU target: lossless, exact counts, tau rises with training."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from embedded.tinymodel import ensure_tiny_model
from tests.conftest import MT_BENCH
from workers.train.drafter.demo import demo_rows, load_target, mt_bench_prompts
from workers.train.drafter.features import with_target_features
from workers.train.drafter.model import ContextCache, DFlashConfig, DFlashDraftModel, add_mask_token
from workers.train.drafter.specdec import (
    AcceptanceStats,
    DFlashProposer,
    greedy_generate,
    speculative_generate,
)
from workers.train.drafter.train import DrafterTrainer, TrainConfig
from workers.train.evaluation import EvalPrompt, evaluate, stop_ids

BUDGET = 96


@dataclass(frozen=True)
class Setup:
    target: torch.nn.Module
    tokenizer: object
    mask_id: int
    layer_ids: tuple[int, ...]
    prompts: list[EvalPrompt]
    stops: set[int]


@pytest.fixture(scope="module")
def setup(model_cache: Path) -> Iterator[Setup]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target, tokenizer = load_target(ensure_tiny_model(model_cache))
    mask_id = add_mask_token(tokenizer, target)
    layer_ids = DFlashConfig.from_target(target.config, mask_id).target_layer_ids
    texts = mt_bench_prompts(MT_BENCH, 72)[64:]          # never among the training prompts
    prompts = [EvalPrompt(str(i), tokenizer.apply_chat_template(
        [{"role": "user", "content": t}], tokenize=True, add_generation_prompt=True,
        enable_thinking=True, return_dict=False)) for i, t in enumerate(texts)]
    yield Setup(target, tokenizer, mask_id, layer_ids, prompts, stop_ids(target, tokenizer))
    torch.set_num_threads(threads)


class TargetOracle:
    """Proposes the target's own greedy continuation, right up to draft ``correct`` (then wrong)."""

    def __init__(self, target: torch.nn.Module, block_size: int, correct: int) -> None:
        self.target, self.block_size, self.correct = target, block_size, correct

    def begin(self) -> None:
        pass

    @torch.no_grad()
    def propose(self, sequence: list[int], new_features: torch.Tensor) -> torch.Tensor:
        ids = list(sequence)
        drafts = []
        for k in range(self.block_size - 1):
            nxt = int(self.target(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            drafts.append(nxt if k < self.correct else (nxt + 1) % 100)
            ids.append(drafts[-1] if k < self.correct else nxt)
        return torch.tensor(drafts)


def test_an_oracle_drafter_is_accepted_in_full_blocks(setup: Setup) -> None:
    block = 8
    prompt = setup.prompts[0].ids
    plain = greedy_generate(setup.target, prompt, BUDGET, setup.stops)
    out = speculative_generate(setup.target, TargetOracle(setup.target, block, block), prompt,
                               setup.layer_ids, BUDGET, setup.stops)
    assert out.tokens == plain.tokens and len(plain.tokens) > 2 * block
    assert out.accepted == [block] * math.ceil((len(out.tokens) - 1) / block)
    assert out.target_forwards == 1 + len(out.accepted)
    assert plain.target_forwards == len(plain.tokens)
    stats = AcceptanceStats.of([out], block)
    assert stats.tau == stats.tau_pooled == block
    assert stats.per_position == [1.0] * (block - 1)
    assert stats.accepted_hist[str(block)] == len(out.accepted)


@pytest.mark.parametrize("correct", [0, 3])
def test_acceptance_stops_at_the_first_wrong_draft(setup: Setup, correct: int) -> None:
    block = 6
    prompt = setup.prompts[1].ids
    out = speculative_generate(setup.target, TargetOracle(setup.target, block, correct), prompt,
                               setup.layer_ids, BUDGET, setup.stops)
    assert out.tokens == greedy_generate(setup.target, prompt, BUDGET, setup.stops).tokens
    assert set(out.accepted) == {correct + 1}
    stats = AcceptanceStats.of([out], block)
    assert stats.per_position == [1.0] * correct + [0.0] * (block - 1 - correct)
    assert stats.tau == correct + 1


def test_the_context_cache_equals_the_full_context(setup: Setup) -> None:
    drafter = DFlashDraftModel.for_target(setup.target, setup.mask_id, init_seed=3).eval()
    features = torch.randn(1, 20, drafter.config.context_dim)
    positions = torch.arange(20)[None]
    block = torch.full((1, 16), setup.mask_id)
    block[0, 0] = 7
    block_positions = torch.arange(20, 36)[None]
    with torch.no_grad():
        full = drafter(block, block_positions, features, positions, None)
        cache = ContextCache()
        drafter(block, torch.arange(12, 28)[None], features[:, :12], positions[:, :12], None,
                cache=cache)
        cached = drafter(block, block_positions, features[:, 12:], positions[:, 12:], None,
                         cache=cache)
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)


def test_lossless_and_training_raises_the_real_acceptance_length(setup: Setup) -> None:
    drafter = DFlashDraftModel.for_target(setup.target, setup.mask_id, init_seed=0)
    untrained = evaluate(setup.target, DFlashProposer(drafter), setup.prompts, setup.layer_ids,
                         BUDGET, setup.stops, check=True)
    rows = demo_rows(setup.target, setup.tokenizer, mt_bench_prompts(MT_BENCH, 64), seed=0)
    rows = [r for r in with_target_features(setup.target, rows, setup.layer_ids)
            if r.row.supervised_tokens >= 32]
    steps = 80
    trainer = DrafterTrainer(drafter, TrainConfig(total_steps=steps, max_anchors=16))
    for step in range(steps):
        first = (step * 4) % (len(rows) - 4)
        trainer.step(rows[first:first + 4])
    trained = evaluate(setup.target, DFlashProposer(drafter), setup.prompts, setup.layer_ids,
                       BUDGET, setup.stops, check=True)
    for report in (untrained, trained):
        assert report.checked == len(setup.prompts) and not report.mismatches
    assert untrained.stats.tau < 1.05
    assert trained.stats.tau > untrained.stats.tau + 0.1, trained.to_json()
    assert trained.stats.target_forwards_per_token < untrained.stats.target_forwards_per_token
    assert trained.stats.per_position[0] > 0.05
