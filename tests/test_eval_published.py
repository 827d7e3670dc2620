"""A published DFlash drafter directory measured like ours: z-lab's layout (``dflash/model.py``,
the ``z-lab/Qwen3-8B-DFlash-b16`` config: ``block_size`` and ``num_target_layers`` at the top,
``dflash_config: {mask_token_id, target_layer_ids}``, bf16 ``model.safetensors``) and
SpecForge's export (``save_pretrained``: ``rope_parameters``, ``layer_types``, sharded weights
with their index), each built here for the tiny target with random weights; a directory the
loader cannot read is one error line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from common import keys
from common.drafter.shape import DrafterShapeError
from common.errors import DrafterMismatch
from common.storage import open_storage
from tests.conftest import Pipeline, TinyTarget
from tests.test_eval_sets import GSM8K, MT_BENCH
from tests.test_generate_e2e import _write_jsonl
from workers.train.drafter.export import export_drafter, load_drafter
from workers.train.drafter.model import DFlashDraftModel, add_mask_token
from workers.train.drafter.target_loader import load_target

BLOCK = 4


def _shape(drafter: DFlashDraftModel) -> dict[str, Any]:
    c = drafter.config
    return {"hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads, "head_dim": c.head_dim,
            "num_key_value_heads": c.num_key_value_heads,
            "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size,
            "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
            "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            "tie_word_embeddings": False, "model_type": "qwen3", "use_cache": True}


def weights(drafter: DFlashDraftModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", torch.bfloat16).contiguous()
            for k, v in drafter.state_dict().items()}


def z_lab_dir(drafter: DFlashDraftModel, out: Path) -> Path:
    """z-lab's published layout: its config keys and one bf16 ``model.safetensors``."""
    c = drafter.config
    out.mkdir(parents=True)
    config = {**_shape(drafter), "architectures": ["DFlashDraftModel"],
              "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": BLOCK,
              "num_target_layers": c.num_target_layers, "rope_theta": c.rope_theta,
              "rope_scaling": None, "torch_dtype": "bfloat16", "bos_token_id": 0,
              "eos_token_id": 1, "transformers_version": "4.57.1",
              "dflash_config": {"mask_token_id": c.mask_token_id,
                                "target_layer_ids": list(c.target_layer_ids)}}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights(drafter), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def specforge_dir(drafter: DFlashDraftModel, out: Path) -> Path:
    """SpecForge's export (save_pretrained): its config keys, weights in two shards + index."""
    c = drafter.config
    out.mkdir(parents=True)
    config = {**_shape(drafter), "architectures": ["DFlashDraftModel"], "dtype": "bfloat16",
              "block_size": BLOCK, "num_target_layers": c.num_target_layers,
              "layer_types": ["full_attention"] * c.num_hidden_layers,
              "use_sliding_window": False, "sliding_window": None, "max_window_layers": 5,
              "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
              "dflash_config": {"target_layer_ids": list(c.target_layer_ids),
                                "mask_token_id": c.mask_token_id}}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = weights(drafter)
    names = sorted(tensors)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for file, part in shards.items():
        save_file({k: tensors[k] for k in part}, str(out / file), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, part in shards.items() for k in part}}))
    return out


def drafter_for(path: Path) -> tuple[Any, Any, DFlashDraftModel]:
    target, tokenizer = load_target(path)
    mask = add_mask_token(tokenizer, target)
    return target, tokenizer, DFlashDraftModel.for_target(target, mask, block_size=BLOCK,
                                                          init_seed=3)


def test_published_layouts_load_as_ours_and_bad_ones_are_one_line(
        target_model: TinyTarget, tmp_path: Path) -> None:
    target, tokenizer, drafter = drafter_for(target_model.path)
    ours = export_drafter(drafter, tmp_path / "ours", dtype=torch.bfloat16)
    loaded = {name: load_drafter(path, target, tokenizer=tokenizer)
              for name, path in (("ours", ours), ("z-lab", z_lab_dir(drafter, tmp_path / "z")),
                                 ("specforge", specforge_dir(drafter, tmp_path / "sf")))}
    for name, model in loaded.items():
        assert model.config.target_layer_ids == drafter.config.target_layer_ids, name
        assert model.config.block_size == BLOCK and model.config.mask_token_id == \
            drafter.config.mask_token_id, name
        for key, tensor in model.state_dict().items():
            assert torch.equal(tensor, loaded["ours"].state_dict()[key]), (name, key)

    def refused(path: Path, change: Any) -> str:
        config = json.loads((path / "config.json").read_text())
        change(config)
        (path / "config.json").write_text(json.dumps(config))
        with pytest.raises((DrafterShapeError, DrafterMismatch)) as caught:
            load_drafter(path, target, tokenizer=tokenizer)
        assert "\n" not in str(caught.value)
        return str(caught.value)

    def arch(c: dict[str, Any]) -> None:
        c["architectures"] = ["DFlash2DraftModel"]

    def conflict(c: dict[str, Any]) -> None:
        c["dflash_config"]["block_size"] = 8

    def no_mask(c: dict[str, Any]) -> None:
        c["dflash_config"].pop("mask_token_id")
        c["dflash_config"]["mask_token"] = "<|not-a-token|>"

    def softcap(c: dict[str, Any]) -> None:
        c["dflash_config"]["final_logit_softcapping"] = 20.0

    def wide(c: dict[str, Any]) -> None:
        c["hidden_size"] = 999

    assert "does not fit the target: hidden size 999" in refused(
        z_lab_dir(drafter, tmp_path / "h"), wide)
    assert "a DFlash2 drafter" in refused(z_lab_dir(drafter, tmp_path / "a"), arch)
    assert "block_size: 4 at the top level, 8 in dflash_config" in refused(
        z_lab_dir(drafter, tmp_path / "b"), conflict)
    assert "has no '<|not-a-token|>'" in refused(z_lab_dir(drafter, tmp_path / "c"), no_mask)
    assert "final_logit_softcapping" in refused(z_lab_dir(drafter, tmp_path / "d"), softcap)
    short = specforge_dir(drafter, tmp_path / "e")
    (short / "model-00002-of-00002.safetensors").unlink()
    assert "weights do not fit its config.json" in refused(short, lambda c: None)
    empty = tmp_path / "f"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    assert "is not a drafter export" in refused(empty, lambda c: None)
    # Unstated: SGLang's mask token by name in the tokenizer, its layer spread over the target.
    unstated = z_lab_dir(drafter, tmp_path / "g")
    config = json.loads((unstated / "config.json").read_text())
    config["dflash_config"] = {}
    (unstated / "config.json").write_text(json.dumps(config))
    model = load_drafter(unstated, target, tokenizer=tokenizer)
    assert model.config.mask_token_id == drafter.config.mask_token_id
    assert len(model.config.target_layer_ids) == drafter.config.num_hidden_layers


@pytest.mark.e2e
def test_a_published_drafter_is_measured_beside_ours(pipeline: Pipeline, tmp_path: Path,
                                                     model_cache: Path) -> None:
    """One command per drafter, one target, the same sets: the same weights in z-lab's and
    SpecForge's layouts give our export's table; each stored under the run by its name."""
    from embedded.tinymodel import ensure_tiny_model

    src = _write_jsonl(tmp_path / "in.jsonl",
                       [json.loads(line) for line in MT_BENCH.read_text().splitlines()[:4]])
    pipeline.cli("enqueue", "--input", src, "--run", "pub", "--mode", "online", "--epochs",
                 "1", check=True)
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    run = json.loads(storage.get(keys.run_config("pub")))
    _, _, drafter = drafter_for(ensure_tiny_model(model_cache, run["model"]))
    dirs = {"ours": export_drafter(drafter, tmp_path / "ours", dtype=torch.bfloat16),
            "z-lab": z_lab_dir(drafter, tmp_path / "Qwen3-tiny-DFlash-b4"),
            "specforge": specforge_dir(drafter, tmp_path / "specforge-export")}
    gsm = _write_jsonl(tmp_path / "test.jsonl", GSM8K)
    tables = {}
    for name, path in dirs.items():
        out = pipeline.cli("eval-drafter", "--run", "pub", "--drafter", str(path), "--num", "2",
                           "--max-new-tokens", "16", "--dataset", f"gsm8k={gsm}", "--dataset",
                           f"mt-bench={MT_BENCH}", "--no-thinking", "--json", check=True)
        tables[name] = json.loads(out.stdout)
        assert tables[name]["stored"] is not None, name
        for row in tables[name]["datasets"].values():
            assert row["lossless"] == {"checked": 2, "mismatches": []}
            assert row["tau"] is not None and row["by_position"]["0-1k"] is not None
    for name in ("z-lab", "specforge"):
        assert tables[name]["datasets"] == tables["ours"]["datasets"], name
    stored = [json.loads(storage.get(t["stored"]))["drafter"]["name"] for t in tables.values()]
    assert stored == ["ours", "Qwen3-tiny-DFlash-b4", "specforge-export"]
    shown = json.loads(pipeline.cli("report", "--run", "pub", "--json", "--no-png",
                                    check=True).stdout)
    assert shown["eval"]["record"]["drafter"]["name"] == "specforge-export"
    bad = pipeline.cli("eval-drafter", "--run", "pub", "--drafter", str(tmp_path),
                       "--dataset", f"gsm8k={gsm}")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert [line for line in bad.stderr.splitlines() if line.startswith("error:")] == [
        line for line in bad.stderr.splitlines() if "is not a drafter export" in line] != []
