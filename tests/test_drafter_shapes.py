"""Drafter shapes from published configs: sliding-window layers (the window as SGLang's DFLASH
serves it), heads and target layers from a ``config.json``, the fields refused, the export
SGLang reads, and a drafter started from a released one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.engine.target import TargetShape
from tests.conftest import TinyTarget
from tests.tolerance import assert_close, differ
from workers.train.drafter.export import export_drafter, hf_config, load_drafter
from workers.train.drafter.masks import decode_mask, dense_block_mask
from workers.train.drafter.model import (
    SLIDING,
    ContextCache,
    DFlashConfig,
    DFlashDraftModel,
    add_mask_token,
)
from workers.train.drafter.shape import DrafterShapeError, read_shape, shaped_config
from workers.train.drafter.target_loader import load_target

SLIDING5 = {"architectures": ["DFlashDraftModel"], "num_hidden_layers": 5,
            "layer_types": [SLIDING] * 5, "sliding_window": 6, "use_sliding_window": True,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 96, "block_size": 8, "dflash_config": {"mask_token_id": None}}


def allowed_by_rule(q_pos: int, q_off: int, kv_pos: int, kv_in_block: bool, kv_off: int,
                    anchor: int, start: int, window: int | None, causal: bool) -> bool:
    """The window as SGLang stores it (window_left = W - 1), one pair at a time."""
    if kv_in_block:
        if causal and kv_off > q_off:
            return False
        return window is None or q_off - kv_off <= window - 1
    if not start <= kv_pos < anchor:
        return False
    return window is None or q_pos - kv_pos <= window - 1


@pytest.mark.parametrize(("window", "causal"), [(None, False), (None, True), (5, True),
                                                (3, False), (20, True)])
def test_masks_follow_the_window_and_causality_rule(window: int | None, causal: bool) -> None:
    block, context = 4, 14
    anchors, starts = torch.tensor([3, 9, 12]), torch.tensor([0, 6, 6])
    mask = dense_block_mask(anchors, starts, context, block, window, causal)
    for q in range(3 * block):
        n, off = divmod(q, block)
        for kv in range(context + 3 * block):
            in_block = kv >= context and (kv - context) // block == n
            expected = (kv < context or in_block) and allowed_by_rule(
                anchors[n].item() + off, off, kv, in_block, (kv - context) % block,
                anchors[n].item(), starts[n].item(), window, causal)
            assert mask[q, kv].item() == expected, (q, kv)
    # Decoding: the same rule from positions (a block at 9..12 over context 0..8).
    dec = decode_mask(torch.arange(9, 13)[None], torch.arange(0, 9)[None], window, causal)
    train = dense_block_mask(torch.tensor([9]), torch.tensor([0]), 9, block, window, causal)
    assert torch.equal(dec[0, 0], train)


@pytest.fixture(scope="module")
def target(target_model: TinyTarget):  # noqa: ANN201
    model, tokenizer = load_target(target_model.path)
    return model, add_mask_token(tokenizer, model)


def sliding_drafter(target, seed: int = 0) -> DFlashDraftModel:  # noqa: ANN001
    model, mask_id = target
    base = DFlashConfig.from_target(model.config, mask_id)
    config = shaped_config(base, read_shape_dict(SLIDING5), TargetShape.of(model.config))
    return DFlashDraftModel(config, model.get_input_embeddings(),
                            model.get_output_embeddings(), init_seed=seed).eval()


def read_shape_dict(data: dict, tmp: Path | None = None) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(tmp or d) / "config.json"
        path.write_text(json.dumps(data))
        return read_shape(path)


def test_a_published_shape_is_taken_and_the_target_gives_the_rest(target) -> None:  # noqa: ANN001
    model, mask_id = target
    drafter = sliding_drafter(target)
    config, shape = drafter.config, TargetShape.of(model.config)
    assert config.layer_types == (SLIDING,) * 5 and config.sliding_window == 6
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 2, 16)
    assert config.block_size == 8 and config.intermediate_size == 96
    assert config.hidden_size == shape.hidden_size and config.mask_token_id == mask_id
    assert config.attention_kinds == ((6, True),)   # sliding layers: causal, as SGLang's default
    out = hf_config(config, torch.float32)
    assert out["layer_types"] == [SLIDING] * 5 and out["sliding_window"] == 6
    assert out["use_sliding_window"] is True and "is_causal" not in out


def test_sliding_decoding_equals_the_training_mask_and_the_cache(target) -> None:  # noqa: ANN001
    drafter = sliding_drafter(target, seed=2)
    c = drafter.config
    features = torch.randn(1, 20, c.context_dim)
    block = torch.full((1, c.block_size), c.mask_token_id)
    block[0, 0] = 11
    positions, block_pos = torch.arange(20)[None], torch.arange(20, 20 + c.block_size)[None]
    train_mask = dense_block_mask(torch.tensor([20]), torch.tensor([0]), 20, c.block_size,
                                  c.sliding_window, True)
    with torch.no_grad():
        decoded = drafter(block, block_pos, features, positions, None)
        trained = drafter(block, block_pos, features, positions, train_mask)
        cache = ContextCache()
        drafter(block, torch.arange(12, 12 + c.block_size)[None], features[:, :12],
                positions[:, :12], None, cache=cache)
        cached = drafter(block, block_pos, features[:, 12:], positions[:, 12:], None,
                         cache=cache)
        model, _ = target
        full = DFlashDraftModel(DFlashConfig(**{**c.__dict__, "layer_types": None}),
                                model.get_input_embeddings(), model.get_output_embeddings())
        full.load_state_dict(drafter.state_dict())
        unwindowed = full.eval()(block, block_pos, features, positions, None)
    assert_close(decoded, trained, rel=1e-5)
    assert_close(cached, decoded, rel=1e-5)
    assert differ(unwindowed, decoded, rel=1e-4)   # the window is in force


def test_a_sliding_export_round_trips_and_starts_a_drafter(target, tmp_path: Path) -> None:  # noqa: ANN001
    from common.drafter.origin import freeze_origin
    from workers.train.drafter.origin import new_drafter

    model, mask_id = target
    shape = TargetShape.of(model.config)
    drafter = sliding_drafter(target, seed=5)
    out = export_drafter(drafter, tmp_path / "released")
    assert load_drafter(out, model).config == drafter.config
    layers = list(drafter.config.target_layer_ids)
    started = new_drafter(model, mask_id, layers, freeze_origin(None, str(out), shape))
    assert started.config == drafter.config
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(started.state_dict()[name], tensor), name
    # Its mask token must be the target's: a released drafter for another tokenizer is refused.
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = mask_id + 1
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterShapeError, match="dflash_config.mask_token_id"):
        new_drafter(model, mask_id, layers, freeze_origin(None, str(out), shape))


@pytest.mark.parametrize(("change", "field"), [
    ({"architectures": ["DFlash2DraftModel"]}, "architectures"),
    ({"architectures": ["DSparkDraftModel"]}, "architectures"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"layer_types": [SLIDING] * 4}, "layer_types"),
    ({"layer_types": ["chunked_attention"] * 5}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
    ({"use_sliding_window": False}, "use_sliding_window"),
    ({"dflash_config": {"attention_mode": "mla"}}, "dflash_config.attention_mode"),
    ({"dflash_config": {"selector_top_k": 16}}, "dflash_config.selector_top_k"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope_parameters"),
    ({"moe_num_experts": 8}, "moe_num_experts"),
])
def test_a_field_the_trainer_cannot_honour_is_named(change: dict, field: str) -> None:
    with pytest.raises(DrafterShapeError, match=field.replace(".", r"\.")):
        read_shape_dict({**SLIDING5, **change})


def test_fields_the_target_contradicts_are_named(target) -> None:  # noqa: ANN001
    model, mask_id = target
    base = DFlashConfig.from_target(model.config, mask_id)
    shape = TargetShape.of(model.config)
    for change, field in (({"hidden_size": 5120}, "hidden_size"),
                          ({"vocab_size": 248320}, "vocab_size"),
                          ({"dflash_config": {"target_layer_ids": [5, 19, 33, 47, 61]}},
                           "target_layer_ids")):
        with pytest.raises(DrafterShapeError, match=field):
            shaped_config(base, read_shape_dict({**SLIDING5, **change}), shape)


def test_training_a_sliding_drafter_and_resuming_from_its_export(
        target_model: TinyTarget, tmp_path: Path) -> None:
    """Train steps on real rows with sliding layers; a drafter started from the export has the
    export's loss on a batch, a fresh one of the same shape another."""
    from common.drafter.origin import freeze_origin
    from embedded.demo_rows import mt_bench_prompts
    from tests.conftest import MT_BENCH
    from tests.models_cache import cached_demo_rows
    from workers.train.drafter.features import with_target_features
    from workers.train.drafter.origin import new_drafter
    from workers.train.drafter.train import DrafterTrainer, TrainConfig

    model, tokenizer = load_target(target_model.path)
    mask_id = add_mask_token(tokenizer, model)
    shape = tmp_path / "shape.json"
    shape.write_text(json.dumps(SLIDING5))
    settings = freeze_origin(str(shape), None, TargetShape.of(model.config))
    layers = DFlashConfig.from_target(model.config, mask_id).target_layer_ids
    rows = cached_demo_rows(target_model.path, model, tokenizer,
                            mt_bench_prompts(MT_BENCH, 48), seed=0)
    featured = [r for r in with_target_features(model, rows, layers)
                if r.row.supervised_tokens >= 32][:12]
    trainer = DrafterTrainer(new_drafter(model, mask_id, layers, settings),
                             TrainConfig(total_steps=6, max_anchors=8))
    losses = [trainer.step(featured[i * 2:i * 2 + 2]).loss for i in range(6)]
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0], losses
    out = export_drafter(trainer, tmp_path / "export")

    def loss_of(drafter: DFlashDraftModel) -> float:
        other = DrafterTrainer(drafter, TrainConfig(total_steps=1, max_anchors=8))
        batch, _ = other.prepare(featured[-2:], torch.Generator().manual_seed(1))
        with torch.no_grad():
            return float(other.forward(batch)[0])

    resumed = new_drafter(model, mask_id, layers,
                          freeze_origin(None, str(out), TargetShape.of(model.config)))
    fresh = new_drafter(model, mask_id, layers, settings)
    assert loss_of(resumed) == pytest.approx(loss_of(trainer.drafter), rel=1e-5)
    assert abs(loss_of(fresh) - loss_of(trainer.drafter)) > 1e-3


@pytest.mark.parametrize(("change", "field"), [
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"architectures": ["DFlash2DraftModel"]}, "DFlash2"),
    ({"hidden_size": 5120}, "hidden_size"),
])
def test_enqueue_refuses_a_shape_the_trainer_cannot_honour_with_one_line(
        tmp_path: Path, model_cache: Path, change: dict, field: str) -> None:
    import os
    import subprocess
    import sys

    from tests.conftest import MT_BENCH, ROOT

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**SLIDING5, **change}))
    env = {**os.environ, "DFLASH_CACHE_DIR": str(model_cache),
           "DFLASH_STORAGE": str(tmp_path / "storage")}
    result = subprocess.run([sys.executable, "-m", "producer.cli", "enqueue", "--run", "r",
                             "--input", str(MT_BENCH), "--mode", "online", "--dry-run",
                             "--drafter-config", str(bad)], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.strip().splitlines()
             if not line.startswith("Preparing")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and field in lines[0], lines


READ_AS_SGLANG = """
import json, sys
from sglang.srt.speculative.dflash_utils import (
    get_dflash_attention_sliding_window_size, get_dflash_layer_types, parse_dflash_draft_config)
config = json.load(open(sys.argv[1]))
parsed = parse_dflash_draft_config(draft_hf_config=config)
print(json.dumps({"layer_types": list(get_dflash_layer_types(config)),
                  "window_left": get_dflash_attention_sliding_window_size(config),
                  "block_size": parsed.block_size, "layers": parsed.num_hidden_layers}))
"""


def test_sglang_reads_the_sliding_export_with_its_own_code(target, tmp_path: Path) -> None:  # noqa: ANN001
    """The export as SGLang 0.5.23's DFLASH reads a draft config (its dflash_utils, in its own
    venv): the layer types, the window as window_left = W - 1, the block and the depth."""
    import subprocess

    from tests.sglang_real import require_sglang

    python = require_sglang()
    out = export_drafter(sliding_drafter(target), tmp_path / "export")
    read = subprocess.run([str(python), "-c", READ_AS_SGLANG, str(out / "config.json")],
                          capture_output=True, text=True, timeout=300)
    assert read.returncode == 0, read.stderr[-2000:]
    seen = json.loads(read.stdout.strip().splitlines()[-1])
    assert seen == {"layer_types": [SLIDING] * 5, "window_left": 6 - 1, "block_size": 8,
                    "layers": 5}
