"""Speculative decoding on the tiny CPU target: lossless, exact counts, tau rises with training."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from common.engine.target import TargetShape
from embedded.demo_rows import mt_bench_prompts
from embedded.tinymodel import ensure_tiny_model
from tests.conftest import HYBRID, MT_BENCH, TARGETS
from tests.models_cache import cached_demo_rows
from tests.tolerance import assert_close
from workers.train.drafter.features import with_target_features
from workers.train.drafter.model import ContextCache, DFlashConfig, DFlashDraftModel, add_mask_token
from workers.train.drafter.specdec import (
    AcceptanceStats,
    DFlashProposer,
    greedy_generate,
    speculative_generate,
)
from workers.train.drafter.target_cache import ROLLBACKS, TargetCache, new_cache, target_forward
from workers.train.drafter.target_loader import load_target
from workers.train.drafter.train import DrafterTrainer, TrainConfig
from workers.train.evaluation import EvalPrompt, evaluate, stop_ids

BUDGET = 96
KINDS = ("dense", "hybrid")


@dataclass(frozen=True)
class Setup:
    kind: str
    target: torch.nn.Module
    tokenizer: object
    mask_id: int
    layer_ids: tuple[int, ...]
    prompts: list[EvalPrompt]
    stops: set[int]
    model_dir: Path


def target_dir(kind: str, model_cache: Path) -> Path:
    """The dense tiny-qwen3, or the hybrid tiny-qwen3.5 (Gated DeltaNet and full attention)."""
    return ensure_tiny_model(model_cache, TARGETS[0] if kind == "dense" else HYBRID)


def load_setup(kind: str, path: Path) -> Setup:
    target, tokenizer = load_target(path)
    mask_id = add_mask_token(tokenizer, target)
    layer_ids = DFlashConfig.from_target(target.config, mask_id).target_layer_ids
    texts = mt_bench_prompts(MT_BENCH, 72)[64:]          # never among the training prompts
    prompts = [EvalPrompt(str(i), tokenizer.apply_chat_template(
        [{"role": "user", "content": t}], tokenize=True, add_generation_prompt=True,
        enable_thinking=True, return_dict=False)) for i, t in enumerate(texts)]
    return Setup(kind, target, tokenizer, mask_id, layer_ids, prompts,
                 stop_ids(target, tokenizer), path)


@pytest.fixture(scope="module")
def setups(model_cache: Path) -> Iterator[Any]:
    """Each target, loaded once for the module when a test first asks for it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    loaded: dict[str, Setup] = {}

    def get(kind: str) -> Setup:
        if kind not in loaded:
            loaded[kind] = load_setup(kind, target_dir(kind, model_cache))
        return loaded[kind]

    yield get
    torch.set_num_threads(threads)


@pytest.fixture(params=KINDS)
def setup(request: pytest.FixtureRequest, setups: Any) -> Setup:
    return setups(request.param)


@pytest.fixture
def hybrid(setups: Any) -> Setup:
    return setups("hybrid")


class TargetOracle:
    """Proposes the target's greedy continuation (known in advance) right up to draft
    ``correct``, then wrong tokens."""

    def __init__(self, prompt: list[int], greedy: list[int], block_size: int,
                 correct: int) -> None:
        self.start, self.greedy = len(prompt), greedy
        self.block_size, self.correct = block_size, correct

    def begin(self) -> None:
        pass

    def propose(self, sequence: list[int], new_features: torch.Tensor) -> torch.Tensor:
        at = len(sequence) - self.start
        right = self.greedy[at:at + self.block_size - 1]
        assert len(right) == self.block_size - 1, "the oracle ran past what it knows"
        return torch.tensor([t if k < self.correct else (t + 1) % 100
                             for k, t in enumerate(right)])


def oracle(setup: Setup, prompt: list[int], block: int, correct: int,
           budget: int = BUDGET) -> TargetOracle:
    """An oracle knowing ``block`` tokens more of greedy decoding than the budget needs."""
    known = greedy_generate(setup.target, prompt, budget + block, set())
    return TargetOracle(prompt, known.tokens, block, correct)


def test_an_oracle_drafter_is_accepted_in_full_blocks(setup: Setup) -> None:
    block = 8
    prompt = setup.prompts[0].ids
    # No stop token: the whole budget, whichever token a near-tie picks.
    plain = greedy_generate(setup.target, prompt, BUDGET, set())
    out = speculative_generate(setup.target, oracle(setup, prompt, block, block), prompt,
                               setup.layer_ids, BUDGET, set())
    assert out.tokens == plain.tokens and len(plain.tokens) == BUDGET > 2 * block
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
    out = speculative_generate(setup.target, oracle(setup, prompt, block, correct), prompt,
                               setup.layer_ids, BUDGET, setup.stops)
    assert out.tokens == greedy_generate(setup.target, prompt, BUDGET, setup.stops).tokens
    assert set(out.accepted) == {correct + 1}
    stats = AcceptanceStats.of([out], block)
    assert stats.per_position == [1.0] * correct + [0.0] * (block - 1 - correct)
    assert stats.tau == correct + 1


def test_a_stop_token_inside_a_block_ends_the_output_there(setup: Setup) -> None:
    block = 8
    prompt = setup.prompts[2].ids
    known = greedy_generate(setup.target, prompt, BUDGET, set()).tokens
    # A token first met past the first block and not at a block's end: its block is
    # accepted in full, and the output ends inside it.
    at = next(i for i in range(block + 1, len(known))
              if known[i] not in known[:i] and i % block)
    stops = {known[at]}
    plain = greedy_generate(setup.target, prompt, BUDGET, stops)
    out = speculative_generate(setup.target, oracle(setup, prompt, block, block), prompt,
                               setup.layer_ids, BUDGET, stops)
    assert out.tokens == plain.tokens == known[:at + 1]
    assert out.accepted == [block] * len(out.accepted)      # counted before the cut
    assert 1 + block * len(out.accepted) > len(out.tokens)


def test_the_budget_ending_inside_a_block_cuts_the_output(setup: Setup) -> None:
    block, budget = 8, 13
    prompt = setup.prompts[3].ids
    plain = greedy_generate(setup.target, prompt, budget, set())
    out = speculative_generate(setup.target, oracle(setup, prompt, block, block), prompt,
                               setup.layer_ids, budget, set())
    assert out.tokens == plain.tokens and len(out.tokens) == budget
    assert out.accepted == [block, block]       # 1 + 8 + 8 tokens, 4 past the budget
    assert out.target_forwards == 3


@pytest.mark.parametrize("rollback", ROLLBACKS)
@pytest.mark.parametrize("kept", [1, 4, 6])
def test_a_hybrid_keeps_exactly_the_accepted_prefix_state(hybrid: Setup, rollback: str,
                                                          kept: int) -> None:
    """After a verify, every linear-attention state equals that of the accepted prefix alone,
    and full-attention layers hold exactly its positions."""
    setup = hybrid
    prompt = setup.prompts[4].ids
    shape = TargetShape.of(setup.target)
    block = torch.tensor([[5, 17, 40, 41, 9, 300]])      # anchor and five drafts
    cache = TargetCache.for_target(setup.target, rollback)
    with torch.no_grad():
        cache.forward(torch.tensor([prompt]))
        cache.verify(block)
        before = [cache.cache.layers[i].recurrent_states[0].clone()
                  for i in shape.linear_attention_layers]
        cache.keep(kept, len(prompt) + kept)
        reference = new_cache(setup.target)
        target_forward(setup.target, torch.tensor([prompt]), reference)
        target_forward(setup.target, block[:, :kept], reference)
        nxt = torch.tensor([[77]])
        got = cache.forward(nxt).logits
        want = target_forward(setup.target, nxt, reference).logits
    # Close, not equal: the chunked and the per-token kernels round differently.
    assert_close(got, want, rel=1e-4, what="logits")
    for i, held in zip(shape.linear_attention_layers, before, strict=True):
        ours, theirs = cache.cache.layers[i], reference.layers[i]
        assert_close(ours.conv_states[0], theirs.conv_states[0], rel=1e-4)
        assert_close(ours.recurrent_states[0], theirs.recurrent_states[0], rel=1e-4)
        if kept < block.shape[1]:      # the verify took in rejected drafts: a crop is not enough
            assert not torch.allclose(held, reference.layers[i].recurrent_states[0])
    for i in shape.full_attention_layers:
        assert cache.cache.layers[i].get_seq_length() == len(prompt) + kept + 1
    # The length the model takes its next positions from (layer 0's, a linear-attention layer's
    # own token count in transformers 5.2x).
    assert cache.cache.get_seq_length() == reference.get_seq_length() == len(prompt) + kept + 1


@pytest.mark.parametrize("rollback", ROLLBACKS)
def test_every_rollback_is_lossless(hybrid: Setup, rollback: str) -> None:
    setup = hybrid
    prompt = setup.prompts[5].ids
    plain = greedy_generate(setup.target, prompt, 40, setup.stops).tokens
    for correct in (0, 2, 7):
        out = speculative_generate(setup.target, oracle(setup, prompt, 8, correct, 40), prompt,
                                   setup.layer_ids, 40, setup.stops, rollback=rollback)
        assert out.tokens == plain
        assert set(out.accepted) == {correct + 1}


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
    assert_close(cached, full, rel=1e-5)


def test_lossless_and_training_raises_the_real_acceptance_length(setup: Setup) -> None:
    # The hybrid runs torch's slow Gated DeltaNet fallback: a short run, losslessness only (tau
    # after training on it: benchmarks/target_layers.py).
    dense = setup.kind == "dense"
    prompts, budget = (setup.prompts, BUDGET) if dense else (setup.prompts[:2], 48)
    drafter = DFlashDraftModel.for_target(setup.target, setup.mask_id, init_seed=0)
    untrained = evaluate(setup.target, DFlashProposer(drafter), prompts, setup.layer_ids,
                         budget, setup.stops, check=True)
    rows = cached_demo_rows(setup.model_dir, setup.target, setup.tokenizer,
                            mt_bench_prompts(MT_BENCH, 64 if dense else 8), seed=0,
                            max_new_tokens=256 if dense else 48)
    rows = [r for r in with_target_features(setup.target, rows, setup.layer_ids)
            if r.row.supervised_tokens >= 32]
    steps = 40 if dense else 8     # 40 dense steps: tau 1.24 measured (untrained 1.00)
    trainer = DrafterTrainer(drafter, TrainConfig(total_steps=steps, max_anchors=16))
    for step in range(steps):
        first = (step * 4) % (len(rows) - 4)
        trainer.step(rows[first:first + 4])
    trained = evaluate(setup.target, DFlashProposer(drafter), prompts, setup.layer_ids,
                       budget, setup.stops, check=True)
    for report in (untrained, trained):
        assert report.checked == len(prompts) and not report.mismatches
    assert untrained.stats.tau < 1.05
    if dense:
        assert trained.stats.tau > untrained.stats.tau + 0.1, trained.to_json()
        assert (trained.stats.target_forwards_per_token
                < untrained.stats.target_forwards_per_token)
        assert trained.stats.per_position[0] > 0.05
