"""plan-storage: the offline hidden-state size, per shard and in total, and its recommendation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from common import keys
from common.errors import ConfigError
from common.runs.records import InputManifest, RunConfig, ShardCommit, dumps
from common.storage import LocalStorage
from producer.cli import main
from producer.plan import human_bytes, storage_plan
from tests.conftest import TinyTarget

FIGURES = ["--samples", "902087", "--mean-tokens", "3000", "--hidden", "5120"]


def invoke(*args: str, env: dict[str, str] | None = None):  # noqa: ANN201
    return CliRunner().invoke(main, ["plan-storage", *args], env=env)


def test_function_gives_the_seed_run_figures() -> None:
    plan = storage_plan(902_087, 3000, 5120, 5)
    assert plan.total_bytes == 902_087 * 3000 * 5120 * 5 * 2
    assert human_bytes(plan.total_bytes) == "138.6 TB (126.0 TiB)"
    assert human_bytes(storage_plan(902_087, 3000, 5120, 3).total_bytes).startswith("83.1 TB")
    assert plan.bytes_per_token == 51_200 and plan.online_bytes == 0
    assert plan.shards == 903 and plan.bytes_per_shard == 1000 * 3000 * 51_200
    assert plan.recommendation == "online" and "online" in plan.reason
    assert storage_plan(902_087, 3000, 5120, 5, dtype="fp8").total_bytes * 2 == plan.total_bytes
    assert storage_plan(902_087, 3000, 5120, 5, dtype="fp32").total_bytes == 2 * plan.total_bytes
    small = storage_plan(1000, 500, 1024, 5)
    assert small.recommendation == "offline" and small.shards == 1
    assert small.bytes_per_shard == small.total_bytes


def test_cli_human_output() -> None:
    result = invoke(*FIGURES, "--layers", "5")
    assert result.exit_code == 0, result.output
    assert "138.6 TB (126.0 TiB)" in result.output
    assert "902,087 samples" in result.output and "3,000 mean tokens" in result.output
    assert "recommendation: online" in result.output
    k3 = invoke(*FIGURES, "--layers", "3")
    assert k3.exit_code == 0 and "83.1 TB" in k3.output
    assert "138.6 TB" in invoke(*FIGURES).output  # K defaults to 5


def test_cli_json_fields() -> None:
    result = invoke(*FIGURES, "--layers", "5", "--shard-size", "500", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["total_bytes"] == 902_087 * 3000 * 5120 * 5 * 2
    assert data["total_tb"] == pytest.approx(138.6, abs=0.05)
    assert data["total_tib"] == pytest.approx(126.0, abs=0.05)
    assert data["shard_size"] == 500 and data["shards"] == 1805
    assert data["bytes_per_shard"] == 500 * 3000 * 51_200
    assert data["online_bytes"] == 0 and data["recommendation"] == "online"
    assert "online" in data["reason"] and data["dtype"] == "bf16"


@pytest.mark.parametrize("args", [
    [],                                                       # neither --run nor the numbers
    ["--samples", "10", "--mean-tokens", "100"],              # no hidden size
    [*FIGURES, "--layers", "0"],
    ["--samples", "-5", "--mean-tokens", "3000", "--hidden", "5120"],
    ["--samples", "10", "--mean-tokens", "0", "--hidden", "5120"],
    [*FIGURES, "--dtype", "int4"],
    ["--run", "../escape"],
])
def test_usage_errors_exit_2(args: list[str]) -> None:
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert "Error" in result.output


def test_function_refuses_bad_values() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        storage_plan(10, 10, 10, 5, dtype="int4")
    with pytest.raises(ConfigError, match="samples"):
        storage_plan(0, 10, 10, 5)


def make_run(root: Path, run: str, model: str = "tiny-qwen3") -> LocalStorage:
    """A run as enqueue and two committed generate shards leave it in storage."""
    storage = LocalStorage(root)
    config = RunConfig(run=run, model=model, input="in.jsonl", format="auto",
                       prompt_field=None, shard_size=50, limit=None)
    storage.put_once(keys.run_config(run), dumps(config.to_json()))
    manifest = InputManifest(shards=3, rows=130, rejected=10, shard_rows=[50, 50, 20])
    storage.put_once(keys.inputs_manifest(run), dumps(manifest.to_json()))
    for shard, (n, prompt, completion) in enumerate([(50, 10_000, 40_000), (50, 20_000, 30_000)]):
        commit = ShardCommit(run=run, shard=shard, parts=[], sample_ids=[], part_of={},
                             stats={"samples": n, "prompt_tokens": prompt,
                                    "completion_tokens": completion}, worker="w")
        storage.put_once(keys.generated_commit(run, shard), dumps(commit.to_json()))
    return storage


def test_cli_reads_the_run(tmp_path: Path, model_cache: Path, target_model: TinyTarget) -> None:
    # The hybrid states its hidden size and layers under text_config only.
    make_run(tmp_path, "r1", target_model.name)
    env = {"DFLASH_STORAGE": str(tmp_path), "DFLASH_CACHE_DIR": str(model_cache)}
    result = invoke("--run", "r1", "--json", env=env)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output.splitlines()[-1])
    # 120 good rows; (10k+40k+20k+30k) tokens over 100 samples; the tiny model's hidden 128.
    assert (data["samples"], data["mean_tokens"], data["hidden_size"]) == (120, 1000, 128)
    assert data["layers"] == 5 and data["shard_size"] == 50 and data["shards"] == 3
    assert data["total_bytes"] == 120 * 1000 * 128 * 5 * 2
    assert data["recommendation"] == "offline"
    assert data["sources"]["samples"] == "inputs manifest"

    overridden = invoke("--run", "r1", "--hidden", "5120", "--samples", "902087", "--json",
                        env=env)
    data = json.loads(overridden.output)
    assert (data["samples"], data["hidden_size"]) == (902_087, 5120)
    assert data["sources"]["samples"] == "option"

    too_many = invoke("--run", "r1", "--layers", "9", env=env)
    assert too_many.exit_code == 1 and "exceeds" in too_many.output


def test_cli_run_errors(tmp_path: Path) -> None:
    missing = invoke("--run", "nope", env={"DFLASH_STORAGE": str(tmp_path)})
    assert missing.exit_code == 1 and "not found" in missing.output
    storage = LocalStorage(tmp_path)
    config = RunConfig(run="fresh", model="tiny-qwen3", input="in.jsonl", format="auto",
                       prompt_field=None, shard_size=50, limit=None)
    storage.put_once(keys.run_config("fresh"), dumps(config.to_json()))
    early = invoke("--run", "fresh", env={"DFLASH_STORAGE": str(tmp_path)})
    assert early.exit_code == 1 and "--mean-tokens" in early.output
