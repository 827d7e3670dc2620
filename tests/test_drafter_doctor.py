"""``doctor --drafter``: a good export of the tiny target passes, every bad one fails with its fix.

Run: ``pytest tests/test_drafter_doctor.py -q``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from embedded.tinymodel import ensure_tiny_model
from producer.doctor.drafter_check import check_drafter, expected_tensors
from tests.conftest import ROOT, RedisServer
from workers.train.drafter.export import export_drafter
from workers.train.drafter.model import DFlashDraftModel, add_mask_token
from workers.train.drafter.target_loader import load_target


@dataclass(frozen=True)
class Exports:
    tiny: Path        # the tiny model as built: no row for the mask token
    served: Path      # the tiny target with the mask row, saved whole (float32), as SGLang serves
    drafter: Path     # a float32 export of a fresh drafter for ``served``

    def target_variant(self, root: Path, **fields: object) -> Path:
        """A copy of the served target's config.json with ``fields`` changed."""
        out = root / ("target-" + "-".join(fields))
        out.mkdir()
        config = json.loads((self.served / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, **fields}))
        return out

    def drafter_copy(self, root: Path, name: str) -> Path:
        out = root / name
        shutil.copytree(self.drafter, out)
        return out


@pytest.fixture(scope="module")
def exports(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Exports:
    root = tmp_path_factory.mktemp("drafter-doctor")
    tiny = ensure_tiny_model(model_cache)
    target, tokenizer = load_target(tiny)
    mask_id = add_mask_token(tokenizer, target)
    served = root / "served-target"
    target.save_pretrained(served)
    tokenizer.save_pretrained(served)
    drafter = export_drafter(DFlashDraftModel.for_target(target, mask_id), root / "drafter",
                             dtype=torch.float32)
    return Exports(Path(tiny), served, drafter)


def rows(drafter: Path, target: Path) -> dict[str, object]:
    return {r.name: r for r in check_drafter(drafter, target)}


def failed(drafter: Path, target: Path) -> dict[str, object]:
    results = check_drafter(drafter, target)
    return {r.name: r for r in results if r.status == "FAIL"}


def test_good_export_passes(exports: Exports) -> None:
    results = check_drafter(exports.drafter, exports.served)
    assert [(r.name, r.status) for r in results] == [
        ("drafter files", "PASS"), ("drafter mask token", "PASS"),
        ("drafter hidden size", "PASS"), ("drafter target layers", "PASS"),
        ("drafter attention layers", "PASS"), ("drafter dtype", "PASS"),
        ("drafter tensors", "PASS")]
    config = json.loads((exports.drafter / "config.json").read_text())
    stored = load_file(str(exports.drafter / "model.safetensors"))
    assert set(stored) == set(expected_tensors(config))   # the loader's rules, on a real export
    assert "float32, as the target" in rows(exports.drafter, exports.served)["drafter dtype"].detail


def test_renamed_tensor_fails_with_fix(exports: Exports, tmp_path: Path) -> None:
    bad = exports.drafter_copy(tmp_path, "renamed")
    weights = load_file(str(bad / "model.safetensors"))
    weights["layers.0.attn.q_proj.weight"] = weights.pop("layers.0.self_attn.q_proj.weight")
    save_file(weights, str(bad / "model.safetensors"))
    fails = failed(bad, exports.served)
    assert list(fails) == ["drafter tensors"]
    detail = fails["drafter tensors"].detail
    assert "ignores (those weights would stay random): layers.0.attn.q_proj.weight" in detail
    assert "missing: layers.0.self_attn.q_proj.weight" in detail
    assert "export-drafter" in fails["drafter tensors"].fix
    # The optional "model." prefix SGLang strips is no problem.
    prefixed = exports.drafter_copy(tmp_path, "prefixed")
    weights = {f"model.{k}": v for k, v in load_file(str(prefixed / "model.safetensors")).items()}
    save_file(weights, str(prefixed / "model.safetensors"))
    assert failed(prefixed, exports.served) == {}


def test_float32_export_for_a_bf16_target_fails_with_fix(exports: Exports,
                                                        tmp_path: Path) -> None:
    bf16 = exports.target_variant(tmp_path, dtype="bfloat16")
    fails = failed(exports.drafter, bf16)
    assert list(fails) == ["drafter dtype"]
    assert "tensors float32, but the target is bfloat16" in fails["drafter dtype"].detail
    assert "--dtype auto" in fails["drafter dtype"].fix


def test_mask_id_outside_the_target_vocab_fails_with_fix(exports: Exports,
                                                        tmp_path: Path) -> None:
    # A target without spare rows (vocab_size = the tokenizer's): the mask row is not there.
    mask_id = json.loads((exports.drafter / "config.json").read_text())["dflash_config"][
        "mask_token_id"]
    fails = failed(exports.drafter, exports.target_variant(tmp_path, vocab_size=mask_id))
    assert list(fails) == ["drafter mask token"]
    assert "outside the target's vocabulary" in fails["drafter mask token"].detail
    assert "spare vocabulary row" in fails["drafter mask token"].fix


def test_wrong_hidden_size_fails_with_fix(exports: Exports, tmp_path: Path) -> None:
    fails = failed(exports.drafter, exports.target_variant(tmp_path, hidden_size=256))
    assert list(fails) == ["drafter hidden size"]
    assert "drafter hidden_size 128 != target hidden_size 256" in fails[
        "drafter hidden size"].detail
    assert "--model" in fails["drafter hidden size"].fix


def test_layer_id_out_of_range_fails_with_fix(exports: Exports, tmp_path: Path) -> None:
    bad = exports.drafter_copy(tmp_path, "layers")
    config = json.loads((bad / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"][-1] = 8    # the tiny target has layers 0..7
    (bad / "config.json").write_text(json.dumps(config))
    fails = failed(bad, exports.served)
    assert list(fails) == ["drafter target layers"]
    assert "[8] not below the target's num_hidden_layers 8" in fails[
        "drafter target layers"].detail
    assert fails["drafter target layers"].fix


def test_not_an_export_fails_with_fix(exports: Exports, tmp_path: Path) -> None:
    [row] = check_drafter(tmp_path, exports.served)
    assert row.status == "FAIL" and "config.json" in row.detail
    assert "export-drafter" in row.fix


def doctor(redis_server: RedisServer, s3_storage: str, model_cache: Path,
           *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    clean |= {"DFLASH_BROKER_URL": redis_server.url, "DFLASH_STORAGE": s3_storage,
              "DFLASH_CACHE_DIR": str(model_cache), "COLUMNS": "1000", **(env or {})}
    return subprocess.run([sys.executable, "-m", "producer.cli", "doctor", "--json", *args],
                          env=clean, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_doctor_command_checks_the_drafter(exports: Exports, redis_server: RedisServer,
                                           s3_storage: str, model_cache: Path,
                                           tmp_path: Path) -> None:
    good = doctor(redis_server, s3_storage, model_cache, "--model", str(exports.served),
                  "--drafter", str(exports.drafter))
    assert good.returncode == 0, good.stdout + good.stderr
    checks = {c["name"]: c for c in json.loads(good.stdout)["checks"]}
    assert {checks[n]["status"] for n in checks if n.startswith("drafter")} == {"PASS"}
    assert checks["sglang"]["status"] == "WARN" and "not installed" in checks["sglang"]["detail"]
    assert checks["nvml"]["status"] == "WARN"
    assert checks["nvml"]["detail"].startswith("no NVIDIA driver")

    # A target whose vocabulary lacks the mask row (no spare rows): the command fails.
    mask_id = json.loads((exports.drafter / "config.json").read_text())["dflash_config"][
        "mask_token_id"]
    tight = exports.target_variant(tmp_path, vocab_size=mask_id)
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        if (exports.served / name).exists():
            (tight / name).symlink_to(exports.served / name)
    bad = doctor(redis_server, s3_storage, model_cache, "--model", str(tight), "--drafter",
                 str(exports.drafter))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    checks = {c["name"]: c for c in json.loads(bad.stdout)["checks"]}
    assert checks["drafter mask token"]["status"] == "FAIL"
    assert checks["drafter mask token"]["fix"]


def test_attention_layers_are_read_as_sglang_reads_them() -> None:
    from producer.doctor.drafter_check import check_attention_layers

    five = {"num_hidden_layers": 5}
    sliding = {**five, "layer_types": ["sliding_attention"] * 5, "sliding_window": 2048}
    assert check_attention_layers(five).status == "PASS"
    good = check_attention_layers(sliding)
    assert good.status == "PASS" and "5 sliding (window 2048" in good.detail
    assert "causal" in check_attention_layers({**sliding, "is_causal": True}).detail
    for bad, words in (({"sliding_window": None}, "SGLang refuses"),
                       ({"layer_types": ["sliding_attention"] * 4}, "one entry per draft layer"),
                       ({"layer_types": ["chunked"] * 5}, "serves only"),
                       ({"use_sliding_window": False}, "use_sliding_window false")):
        result = check_attention_layers({**sliding, **bad})
        assert result.status == "FAIL" and words in result.detail, result
