"""Export and ``doctor --drafter`` on a hybrid target in Qwen3.6's on-disk shape.

The target is a random tiny ``Qwen3_5ForConditionalGeneration`` (nested ``text_config``, 3 linear
: 1 full attention layers, a vision tower, spare vocabulary rows, bf16 on disk) with the tiny
model's tokenizer: a good export passes every row, each bad one fails with its fix, and doctor
warns about SGLang's mamba state cache once SGLang is the engine. Run:
``pytest tests/test_hybrid_drafter_doctor.py -q``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from common.engine.target import TargetShape
from embedded.tinymodel import ensure_tiny_model
from producer.doctor.drafter_check import check_drafter
from tests.conftest import RedisServer
from tests.test_drafter_doctor import doctor
from workers.train.drafter.export import export_drafter, load_drafter, target_dtype
from workers.train.drafter.model import DFlashDraftModel, add_mask_token

SPARE_ROWS = 8


@dataclass(frozen=True)
class Hybrid:
    target: Path      # the checkpoint as saved (bf16, nested text_config)
    drafter: Path     # its export in the target's dtype
    model: object     # the target loaded as the causal LM the pipeline uses

    def target_variant(self, root: Path, **text: object) -> Path:
        """A copy of the target's config.json with ``text_config`` fields changed."""
        out = root / ("target-" + "-".join(text))
        out.mkdir()
        config = json.loads((self.target / "config.json").read_text())
        config["text_config"] = {**config["text_config"], **text}
        (out / "config.json").write_text(json.dumps(config))
        return out

    def drafter_variant(self, root: Path, name: str, **dflash: object) -> Path:
        out = root / name
        shutil.copytree(self.drafter, out)
        config = json.loads((out / "config.json").read_text())
        config["dflash_config"] = {**config["dflash_config"], **dflash}
        (out / "config.json").write_text(json.dumps(config))
        return out


def save_tiny_hybrid(out: Path, tokenizer_dir: Path, vocab_size: int) -> Path:
    """A random Qwen3.5-family checkpoint of Qwen3.6's layout, saved as Qwen3.6 ships (bf16)."""
    from transformers import AutoTokenizer, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=128, vocab_size=vocab_size,
                max_position_embeddings=262144, linear_num_value_heads=4, linear_num_key_heads=2,
                linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False,
                rope_parameters={"rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                 "rope_type": "default", "mrope_section": [2, 1, 1]})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    # Qwen3.6's config.json states its dtype in text_config only (the shape file's layout).
    data = json.loads((out / "config.json").read_text())
    data["text_config"]["torch_dtype"] = data.pop("dtype")
    (out / "config.json").write_text(json.dumps(data, indent=2))
    return out


@pytest.fixture(scope="module")
def hybrid(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Hybrid:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("hybrid-doctor")
    tiny = Path(ensure_tiny_model(model_cache))
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    target = save_tiny_hybrid(root / "target", tiny, len(tokenizer) + SPARE_ROWS)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    mask_id = add_mask_token(tokenizer, model)   # a spare row: no resize
    assert model.get_input_embeddings().num_embeddings == len(tokenizer) - 1 + SPARE_ROWS
    drafter = export_drafter(DFlashDraftModel.for_target(model, mask_id), root / "drafter",
                             dtype=target_dtype(target))
    return Hybrid(target, drafter, model)


def failed(drafter: Path, target: Path) -> dict[str, object]:
    return {r.name: r for r in check_drafter(drafter, target) if r.status == "FAIL"}


def test_export_carries_what_sglang_needs_for_the_hybrid(hybrid: Hybrid) -> None:
    shape = TargetShape.from_dir(hybrid.target)
    assert shape.is_hybrid and shape.dtype == "bfloat16" and shape.num_layers == 8
    assert "dtype" not in json.loads((hybrid.target / "config.json").read_text())
    assert target_dtype(hybrid.target) == torch.bfloat16          # read from text_config
    config = json.loads((hybrid.drafter / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"]["num_target_layers"] == config["num_target_layers"] == 8
    assert config["dflash_config"]["mask_token_id"] < shape.vocab_size
    assert (config["vocab_size"], config["hidden_size"]) == (shape.vocab_size, shape.hidden_size)
    assert config["max_position_embeddings"] == 262144 and config["rope_theta"] == 1e7
    assert config["layer_types"] == ["full_attention"] * 5 and config["dtype"] == "bfloat16"
    # It loads back onto the hybrid target (the fit is read through TargetShape too).
    drafter = load_drafter(hybrid.drafter, hybrid.model)
    assert drafter.config.num_target_layers == 8


def test_good_hybrid_export_passes_every_row(hybrid: Hybrid) -> None:
    results = check_drafter(hybrid.drafter, hybrid.target)
    assert [(r.name, r.status) for r in results] == [
        ("drafter files", "PASS"), ("drafter mask token", "PASS"),
        ("drafter hidden size", "PASS"), ("drafter target layers", "PASS"),
        ("drafter attention layers", "PASS"), ("drafter dtype", "PASS"),
        ("drafter tensors", "PASS")]
    layers = {r.name: r for r in results}["drafter target layers"].detail
    assert "of a hybrid target (1:linear, 2:linear, 3:full, 4:linear, 5:linear)" in layers
    assert "bfloat16, as the target" in {r.name: r for r in results}["drafter dtype"].detail


def test_each_bad_hybrid_case_fails_with_its_fix(hybrid: Hybrid, tmp_path: Path) -> None:
    cases = [
        (hybrid.drafter, hybrid.target_variant(tmp_path, hidden_size=128),
         "drafter hidden size", "drafter hidden_size 64 != target hidden_size 128", "--model"),
        (hybrid.drafter, hybrid.target_variant(tmp_path, vocab_size=100),
         "drafter mask token", "outside the target's vocabulary (vocab_size 100)",
         "spare vocabulary row"),
        (hybrid.drafter, hybrid.target_variant(tmp_path, torch_dtype="float16"),
         "drafter dtype", "the target is float16", "--dtype auto"),
        (hybrid.drafter_variant(tmp_path, "depth", num_target_layers=64), hybrid.target,
         "drafter target layers", "trained on a 64-layer target, this one has 8 layers",
         "--model"),
        (hybrid.drafter_variant(tmp_path, "ids", target_layer_ids=[1, 2, 3, 4, 8]), hybrid.target,
         "drafter target layers", "[8] not below the target's num_hidden_layers 8", "--model"),
    ]
    for drafter, target, row, detail, fix in cases:
        fails = failed(drafter, target)
        assert list(fails) == [row], (row, fails)
        assert detail in fails[row].detail and fix in fails[row].fix


def test_doctor_on_the_hybrid_passes_and_warns_about_the_mamba_cache(
        hybrid: Hybrid, redis_server: RedisServer, s3_storage: str, model_cache: Path) -> None:
    args = ("--model", str(hybrid.target), "--drafter", str(hybrid.drafter))
    good = doctor(redis_server, s3_storage, model_cache, *args)
    assert good.returncode == 0, good.stdout + good.stderr
    checks = {c["name"]: c for c in json.loads(good.stdout)["checks"]}
    assert {checks[n]["status"] for n in checks if n.startswith("drafter")} == {"PASS"}
    assert checks["model"]["status"] == "PASS"
    line = checks["drafter serve line"]["detail"]
    assert "--speculative-algorithm DFLASH" in line and str(hybrid.drafter) in line
    assert "mamba state cache" not in checks      # a CPU host with the CPU engine: no SGLang

    sglang = doctor(redis_server, s3_storage, model_cache, *args,
                    env={"DFLASH_ENGINE": "sglang", "DFLASH_MAX_IN_FLIGHT": "32"})
    assert sglang.returncode == 0, sglang.stdout + sglang.stderr
    mamba = {c["name"]: c for c in json.loads(sglang.stdout)["checks"]}["mamba state cache"]
    assert mamba["status"] == "PASS"      # SGLang sizes the cache; the worker reads it back
    # SGLang resolves the unstated strategy to extra_buffer on a GPU: 3 + 2 tracking slots
    assert "5 state slots per running request" in mamba["detail"]
    capped = doctor(redis_server, s3_storage, model_cache, *args,
                    env={"DFLASH_ENGINE": "sglang", "DFLASH_MAX_IN_FLIGHT": "32",
                         "DFLASH_ENGINE_ARGS": "--max-mamba-cache-size 48"})
    mamba = {c["name"]: c for c in json.loads(capped.stdout)["checks"]}["mamba state cache"]
    assert mamba["status"] == "WARN" and "at 9 running requests of the 32" in mamba["detail"]
