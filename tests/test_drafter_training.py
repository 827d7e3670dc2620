"""DFlash drafter on the tiny CPU target: it learns, resumes identically, exports and reloads."""

from __future__ import annotations

import copy
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.engine.target import TargetShape
from common.errors import NothingToTrain
from common.runs.trainrows import TrainingRow
from embedded.demo_rows import mt_bench_prompts
from tests.conftest import MT_BENCH, TinyTarget
from tests.models_cache import cached_demo_rows
from tests.tolerance import assert_close, differ
from workers.train.drafter.export import export_drafter, load_drafter
from workers.train.drafter.features import FeaturedRow, target_features, with_target_features
from workers.train.drafter.masks import dense_block_mask
from workers.train.drafter.model import DFlashConfig, DFlashDraftModel, add_mask_token
from workers.train.drafter.target_loader import load_target
from workers.train.drafter.train import DrafterTrainer, TrainConfig, lr_factor

BATCH_ROWS = 4


@dataclass(frozen=True)
class Tiny:
    target: torch.nn.Module
    mask_id: int
    layer_ids: tuple[int, ...]
    train: list[FeaturedRow]
    held_out: list[FeaturedRow]
    hybrid: bool = False

    def drafter(self, seed: int) -> DFlashDraftModel:
        return DFlashDraftModel.for_target(self.target, self.mask_id, init_seed=seed)

    def batch(self, step: int) -> list[FeaturedRow]:
        start = (step * BATCH_ROWS) % (len(self.train) - BATCH_ROWS)
        return self.train[start:start + BATCH_ROWS]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is several times faster on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(target_model: TinyTarget, one_thread: None) -> Tiny:
    """Each tiny target (dense, hybrid) answering 48 MT-Bench prompts (seeded), rows long
    enough for a block."""
    target, tokenizer = load_target(target_model.path)
    mask_id = add_mask_token(tokenizer, target)
    layer_ids = DFlashConfig.from_target(target.config, mask_id).target_layer_ids
    rows = cached_demo_rows(target_model.path, target, tokenizer, mt_bench_prompts(MT_BENCH, 48),
                            seed=0)
    featured = [r for r in with_target_features(target, rows, layer_ids)
                if r.row.supervised_tokens >= 32]
    assert len(featured) >= 20, [r.supervised_tokens for r in rows]
    return Tiny(target, mask_id, layer_ids, featured[:-8], featured[-8:], target_model.hybrid)


def test_training_lowers_loss_and_doubles_slot1_accuracy(tiny: Tiny) -> None:
    steps = 40
    trainer = DrafterTrainer(tiny.drafter(0), TrainConfig(total_steps=steps, max_anchors=8))
    judge = DrafterTrainer(trainer.drafter, TrainConfig(total_steps=1))   # every anchor
    before = judge.evaluate(tiny.held_out)
    metrics = [trainer.step(tiny.batch(s)) for s in range(steps)]
    after = judge.evaluate(tiny.held_out)
    assert trainer.steps == steps and metrics[-1].step == steps
    # Down by over a third on held-out rows (seeded: 0.59x on the dense target, whose zero spare
    # vocabulary rows take part in every softmax; 0.5x or less on the hybrid).
    assert after.loss < 0.65 * before.loss, (before.summary(), after.summary())
    assert after.slot_accuracy[0] >= max(2 * before.slot_accuracy[0], 0.1), after.summary()
    assert after.acceptance_length > before.acceptance_length
    early = sum(m.loss for m in metrics[:5]) / 5
    late = sum(m.loss for m in metrics[-5:]) / 5
    # On the training batches too (both targets' replies: the dense one's spare vocabulary
    # rows are zero, a floor under every softmax that the drafter cannot lower).
    assert late < 0.8 * early
    assert metrics[-1].lr < metrics[steps // 2].lr < metrics[1].lr
    assert all(m.tokens_per_s > 0 and m.blocks > 0 for m in metrics)


def test_schedule_warms_up_then_decays_to_zero() -> None:
    config = TrainConfig(total_steps=100)
    assert config.warmup_steps == 4
    factors = [lr_factor(s, config.warmup_steps, config.total_steps) for s in range(101)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(factors[3:], factors[4:], strict=False))
    assert factors[52] == pytest.approx(0.5) and factors[100] == pytest.approx(0.0)


def test_state_dict_round_trip_continues_identically(tiny: Tiny) -> None:
    config = TrainConfig(total_steps=10, max_anchors=8, seed=1)
    first = DrafterTrainer(tiny.drafter(1), config)
    for s in range(3):
        first.step(tiny.batch(s))
    buffer = io.BytesIO()
    torch.save(copy.deepcopy(first.state_dict()), buffer)
    buffer.seek(0)
    state = torch.load(buffer)
    resumed = DrafterTrainer(tiny.drafter(2), config)
    resumed.load_state_dict(state)
    rebuilt = DrafterTrainer.from_state_dict(copy.deepcopy(state), tiny.target)
    reseeded = DrafterTrainer.from_state_dict(copy.deepcopy(state), tiny.target)
    reseeded.generator.manual_seed(123)                 # everything restored but the RNG
    assert resumed.steps == 3
    for p_first, p_resumed in zip(first.drafter.parameters(), resumed.drafter.parameters(),
                                  strict=True):
        state_a, state_b = first.optimizer.state[p_first], resumed.optimizer.state[p_resumed]
        assert set(state_a) == {"step", "exp_avg", "exp_avg_sq"}
        for key in state_a:
            assert torch.equal(state_a[key], state_b[key]), key
    assert resumed.schedule == first.schedule
    losses_first = [first.step(tiny.batch(s)).loss for s in range(3, 6)]
    for other in (resumed, rebuilt):
        assert [other.step(tiny.batch(s)).loss for s in range(3, 6)] == losses_first
        for a, b in zip(first.drafter.parameters(), other.drafter.parameters(), strict=True):
            assert torch.equal(a, b)
    assert [reseeded.step(tiny.batch(s)).loss for s in range(3, 6)] != losses_first


def test_chunked_logits_match_whole_batch(tiny: Tiny) -> None:
    whole = DrafterTrainer(tiny.drafter(7), TrainConfig(total_steps=2, max_anchors=8))
    chunked = DrafterTrainer(tiny.drafter(7), TrainConfig(total_steps=2, max_anchors=8,
                                                          logits_chunk=64))
    a, b = whole.step(tiny.batch(0)), chunked.step(tiny.batch(0))
    assert b.labels > 64 * 3
    assert b.loss == pytest.approx(a.loss, rel=1e-5) and b.slot_accuracy == a.slot_accuracy
    for p, q in zip(whole.drafter.parameters(), chunked.drafter.parameters(), strict=True):
        assert_close(p, q, rel=1e-5)


def test_export_reload_reproduces_logits(tiny: Tiny, tmp_path: Path) -> None:
    trainer = DrafterTrainer(tiny.drafter(3), TrainConfig(total_steps=4, max_anchors=8))
    for s in range(2):
        trainer.step(tiny.batch(s))
    out = export_drafter(trainer, tmp_path / "drafter")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    target = tiny.target.config
    assert config["block_size"] == 16 and config["num_hidden_layers"] == 5
    assert config["num_target_layers"] == TargetShape.of(target).num_layers
    assert config["dflash_config"]["mask_token_id"] == tiny.mask_id
    assert config["dflash_config"]["target_layer_ids"] == list(tiny.layer_ids)
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "rms_norm_eps", "vocab_size"):
        assert config[key] == getattr(target, key), key
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(trainer.drafter.state_dict())
    assert not any("embed" in k or "lm_head" in k for k in weights)
    assert weights["fc.weight"].shape == (target.hidden_size, 5 * target.hidden_size)

    reloaded = load_drafter(out, tiny.target).eval()
    trainer.drafter.eval()
    batch, _ = trainer.prepare(tiny.held_out, torch.Generator().manual_seed(0))
    mask = dense_block_mask(batch.anchors, batch.starts, batch.tokens, 16)
    args = (batch.block_ids[None], batch.block_positions[None], batch.features[None],
            batch.context_positions[None], mask)
    with torch.no_grad():
        expected = trainer.drafter.logits(trainer.drafter(*args))
        got = reloaded.logits(reloaded(*args))
        untrained = tiny.drafter(3).logits(tiny.drafter(3)(*args))
    assert_close(got, expected, rel=1e-5, what="reloaded logits")
    assert differ(untrained, expected, rel=1e-3)


def test_drafter_shares_frozen_target_embedding_and_head(tiny: Tiny) -> None:
    drafter = tiny.drafter(4)
    embed = tiny.target.get_input_embeddings().weight
    before = embed.detach().clone()
    assert all(p is not embed for p in drafter.parameters())
    assert not any("embed" in k or "lm_head" in k for k in drafter.state_dict())
    DrafterTrainer(drafter, TrainConfig(total_steps=2, max_anchors=8)).step(tiny.batch(0))
    assert torch.equal(embed, before) and not embed.requires_grad


def test_online_features_match_single_row_hidden_states(tiny: Tiny) -> None:
    rows = [r.row for r in tiny.held_out[:3]]
    assert len({len(r.input_ids) for r in rows}) > 1, "want rows of different lengths"
    feats = target_features(tiny.target, rows, tiny.layer_ids)
    for row, got in zip(rows, feats, strict=True):
        with torch.no_grad():
            out = tiny.target(torch.tensor([row.input_ids]), output_hidden_states=True)
        expected = torch.cat([out.hidden_states[i + 1][0] for i in tiny.layer_ids], dim=-1)
        assert got.shape == (len(row.input_ids), 5 * TargetShape.of(tiny.target).hidden_size)
        assert_close(got, expected, rel=1e-5, what="features")


def test_short_rows_are_skipped(tiny: Tiny) -> None:
    trainer = DrafterTrainer(tiny.drafter(5), TrainConfig(total_steps=2, max_anchors=8))
    short = TrainingRow("short", 0, list(range(40)), [0] * 10 + [1] * 30)
    short_row = FeaturedRow(short, torch.zeros(40, 5 * TargetShape.of(tiny.target).hidden_size))
    metrics = trainer.step([short_row, *tiny.batch(0)[:1]])
    assert metrics.rows == 1 and metrics.skipped_rows == 1
    with pytest.raises(NothingToTrain):
        trainer.step([short_row])
    assert trainer.steps == 1


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_matches_dense_in_the_model(tiny: Tiny) -> None:
    pytest.importorskip("torch.nn.attention.flex_attention")
    drafter = tiny.drafter(6)
    dense = DrafterTrainer(drafter, TrainConfig(total_steps=1, max_anchors=8, attention="sdpa"))
    flex = DrafterTrainer(drafter, TrainConfig(total_steps=1, max_anchors=8, attention="flex"))
    a, b = dense.evaluate(tiny.held_out[:4]), flex.evaluate(tiny.held_out[:4])
    assert a.blocks == b.blocks and a.loss == pytest.approx(b.loss, rel=1e-4)


def test_export_follows_a_bf16_target(tiny: Tiny, tmp_path: Path) -> None:
    from workers.train.drafter.export import target_dtype

    model_dir = tmp_path / "bf16-target"
    model_dir.mkdir()
    config = json.loads((Path(tiny.target.name_or_path) / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    assert target_dtype(model_dir) == torch.bfloat16
    assert target_dtype(tiny.target.name_or_path) == torch.float32
    assert target_dtype(tmp_path) is None  # no config.json: the checkpoint's own dtype
    trainer = DrafterTrainer(tiny.drafter(5), TrainConfig(total_steps=2, max_anchors=8))
    out = export_drafter(trainer, tmp_path / "drafter", dtype=target_dtype(model_dir))
    exported = json.loads((out / "config.json").read_text())
    assert exported["dtype"] == exported["torch_dtype"] == "bfloat16"
    weights = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    reloaded = load_drafter(out, tiny.target)
    assert all(torch.equal(p.to(torch.bfloat16), q.to(torch.bfloat16)) for p, q in
               zip(trainer.drafter.state_dict().values(), reloaded.state_dict().values(),
                   strict=True))
