"""Our sliding-window drafter equals SpecForge's DFlash draft model (PyPI ``specforge==0.2.0``,
fetched at test time: ``pip download --no-deps``; never copied here): the same weights, the
same packed batch longer than the window, SpecForge's own mask builder, the same logits.

Only SpecForge's model and mask modules are imported (its package ``__init__`` pulls in its
whole training stack); the test skips with one line when the wheel cannot be fetched.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import types
import zipfile

import pytest
import torch

from common.config import default_cache_dir
from tests.conftest import TinyTarget
from tests.tolerance import assert_close, differ
from workers.train.drafter.masks import dense_block_mask
from workers.train.drafter.model import SLIDING, DFlashConfig, DFlashDraftModel, add_mask_token
from workers.train.drafter.target_loader import load_target

SPECFORGE = "specforge==0.2.0"
WINDOW, BLOCK = 24, 8


def specforge_modules() -> tuple[types.ModuleType, types.ModuleType]:
    """SpecForge's ``dflash`` model module and its mask module, from the published wheel."""
    root = default_cache_dir() / "references" / SPECFORGE.replace("==", "-")
    if not (root / "specforge").is_dir():
        wheels = root.parent / "wheels"
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                                  "-d", str(wheels), SPECFORGE], capture_output=True, text=True,
                                 timeout=300)
        found = sorted(wheels.glob("specforge-0.2.0-*.whl"))
        if fetched.returncode != 0 or not found:
            pytest.skip(f"{SPECFORGE} not fetched (pip download: "
                        f"{fetched.stderr.strip().splitlines()[-1:]}); the equivalence needs it")
        with zipfile.ZipFile(found[0]) as wheel:
            wheel.extractall(root)
    for name in ("specforge", "specforge.modeling", "specforge.modeling.draft",
                 "specforge.core", "specforge.algorithms", "specforge.algorithms.common"):
        if name not in sys.modules:   # bare packages: the modules below import what they need
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*name.split(".")))]
            sys.modules[name] = package
    return (importlib.import_module("specforge.modeling.draft.dflash"),
            importlib.import_module("specforge.algorithms.common.dflash_family_model"))


def test_a_sliding_drafter_equals_specforges_on_a_batch_longer_than_the_window(
        target_model: TinyTarget) -> None:
    dflash, family = specforge_modules()
    from transformers import Qwen3Config

    target, tokenizer = load_target(target_model.path)
    mask_id = add_mask_token(tokenizer, target)
    base = DFlashConfig.from_target(target.config, mask_id)
    config = DFlashConfig(**{**base.__dict__, "layer_types": (SLIDING,) * 5,
                             "sliding_window": WINDOW, "block_size": BLOCK})
    ours = DFlashDraftModel(config, target.get_input_embeddings(),
                            target.get_output_embeddings(), init_seed=7).eval()
    reference_config = Qwen3Config(
        hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
        intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
        num_hidden_layers=5, rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_theta": config.rope_theta, "rope_type": "default"},
        max_position_embeddings=config.max_position_embeddings, layer_types=[SLIDING] * 5,
        sliding_window=WINDOW, use_sliding_window=True, attention_bias=False)
    reference_config.block_size = BLOCK
    reference_config.num_target_layers = config.num_target_layers
    reference_config.dflash_config = {"target_layer_ids": list(config.target_layer_ids),
                                      "mask_token_id": mask_id}
    reference_config._attn_implementation = "sdpa"
    theirs = dflash.DFlashDraftModel(reference_config).eval()
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)

    # One sequence of 80 positions (> 3 windows), blocks anchored at 10, 37 and 70.
    context_len, anchors = 80, torch.tensor([10, 37, 70])
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1, context_len, config.context_dim, generator=generator)
    block_ids = torch.full((1, 3 * BLOCK), mask_id)
    block_ids[0, ::BLOCK] = torch.randint(0, 500, (3,), generator=generator)
    block_positions = (anchors[:, None] + torch.arange(BLOCK)).reshape(1, -1)
    context_positions = torch.arange(context_len)[None]
    ours_mask = dense_block_mask(anchors, torch.tensor([0, 0, 0]), context_len, BLOCK, WINDOW,
                                 True)
    their_mask = family.create_dflash_sdpa_mask(anchors[None], torch.ones(1, 3, dtype=torch.bool),
                                                context_len, BLOCK, "cpu",
                                                sliding_window=WINDOW)
    assert torch.equal(ours_mask, their_mask[0, 0])   # the same window rule
    with torch.no_grad():
        mine = ours.logits(ours(block_ids, block_positions, features, context_positions,
                                ours_mask))
        hidden = theirs(position_ids=torch.cat([context_positions, block_positions], 1),
                        attention_mask=their_mask,
                        noise_embedding=target.get_input_embeddings()(block_ids),
                        target_hidden=features)
        reference = target.get_output_embeddings()(hidden)
        unwindowed = ours.logits(ours(block_ids, block_positions, features, context_positions,
                                      dense_block_mask(anchors, torch.zeros(3, dtype=torch.long),
                                                       context_len, BLOCK)))
    assert_close(mine, reference, rel=2e-5, what="logits")
    assert differ(unwindowed, reference, rel=1e-4)   # the window matters here
