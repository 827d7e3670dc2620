"""The drafter belongs to the run: ``enqueue --drafter-config/--init-drafter`` freeze its shape
(and starting weights) in run.json, checked against the target before anything is queued, and
without them the target's own shape is frozen; train workers train that shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.drafter.origin import freeze_origin, weights_digest
from common.drafter.shape import DrafterShapeError
from common.engine.target import TargetShape
from common.runs.records import RunConfig
from common.storage import open_storage
from tests.conftest import MT_BENCH, ROOT, Pipeline, RedisServer, TinyTarget, wait_until
from tests.tolerance import assert_close

# A published-style config: two layers, its own block, and the target layers [1, 3, 5]
# (the dense tiny target's default is the spread [1, 2, 3, 4, 5], the hybrid's [4]).
PUBLISHED = {"architectures": ["DFlashDraftModel"], "num_hidden_layers": 2, "block_size": 8,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
             "dflash_config": {"target_layer_ids": [1, 3, 5]}}


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producer.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def env(tmp_path: Path, model_cache: Path, target_model: TinyTarget) -> dict[str, str]:
    return {**os.environ, "DFLASH_CACHE_DIR": str(model_cache), "DFLASH_MODEL": target_model.name,
            "DFLASH_STORAGE": str(tmp_path / "storage"),
            "DFLASH_BROKER_URL": "redis://127.0.0.1:1/0"}   # unused unless a test sets one


def published(tmp_path: Path, **change: object) -> Path:
    path = tmp_path / "qwen-dflash.json"
    path.write_text(json.dumps({**PUBLISHED, **change}))
    return path


ENQUEUE = ("enqueue", "--input", str(MT_BENCH), "--limit", "8", "--shard-size", "4",
           "--mode", "online", "--run", "r")


def one_error(result: subprocess.CompletedProcess[str], code: int, *named: str) -> None:
    lines = [line for line in result.stderr.splitlines() if not line.startswith("Preparing")]
    assert result.returncode == code and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and all(n in lines[0] for n in named), lines


def test_the_drafter_configs_layers_become_the_runs_and_a_disagreement_is_refused(
        env: dict[str, str], tmp_path: Path, redis_server: RedisServer) -> None:
    """The issue's example: layers [1, 3, 5] in the config become the run's at enqueue (dry run
    and real); ``--target-layers`` naming others is one line, exit 2, nothing written."""
    config = published(tmp_path)
    dry = cli(env, *ENQUEUE, "--drafter-config", str(config), "--dry-run", "--show", "0",
              "--json")
    assert dry.returncode == 0, dry.stderr
    shown = json.loads(dry.stdout)["drafter"]
    assert shown["target_layer_ids"] == [1, 3, 5] and shown["name"] == "qwen-dflash.json"
    refused = cli(env, *ENQUEUE, "--drafter-config", str(config), "--target-layers", "1,2,5")
    one_error(refused, 2, "--target-layers", "target_layer_ids [1, 3, 5]")
    one_error(cli(env, *ENQUEUE, "--drafter-config", str(config), "--target-layers", "1,2,5",
                  "--dry-run"), 2, "target_layer_ids")
    assert not (tmp_path / "storage").exists(), "a refused enqueue wrote something"

    env = {**env, "DFLASH_BROKER_URL": redis_server.url}
    done = cli(env, *ENQUEUE, "--drafter-config", str(config), "--target-layers", "1,3,5")
    assert done.returncode == 0, done.stderr
    assert "drafter shape: qwen-dflash.json (sha256 " in done.stdout, done.stdout
    run = RunConfig.from_json(json.loads(open_storage(env["DFLASH_STORAGE"]).get(
        "runs/r/run.json")))
    assert run.target_layer_ids == [1, 3, 5] and run.target_layers == 3
    assert run.drafter.kind == "config" and run.drafter.config == {**PUBLISHED}
    assert len(run.drafter.sha256) == 64
    # The same options again are the same run; the shape left out, or another, is not.
    again = cli(env, *ENQUEUE, "--drafter-config", str(config))
    assert again.returncode == 0, again.stderr
    one_error(cli(env, *ENQUEUE), 4, "drafter")
    one_error(cli(env, *ENQUEUE, "--drafter-config", str(published(tmp_path,
                                                                   num_hidden_layers=3))),
              4, "drafter.config.num_hidden_layers")
    status = json.loads(cli(env, "status", "--run", "r", "--json").stdout)
    assert status["drafter"]["name"] == "qwen-dflash.json"
    assert status["drafter"]["sha256"] == run.drafter.sha256


@pytest.mark.parametrize(("change", "field"), [
    ({"hidden_size": 5120}, "hidden_size"),
    ({"dflash_config": {"target_layer_ids": [1, 30]}}, "target_layer_ids"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_a_config_the_target_contradicts_is_refused_at_enqueue(
        env: dict[str, str], tmp_path: Path, change: dict, field: str) -> None:
    for dry in ((), ("--dry-run",)):
        result = cli(env, *ENQUEUE, "--drafter-config", str(published(tmp_path, **change)),
                     *dry)
        one_error(result, 2, field)
    both = cli(env, *ENQUEUE, "--drafter-config", str(published(tmp_path)), "--init-drafter",
               str(tmp_path), "--dry-run")
    one_error(both, 2, "--init-drafter brings its own shape")
    eagle = cli(env, *ENQUEUE, "--drafter-config", str(published(tmp_path)), "--layout",
                "eagle3", "--dry-run")
    one_error(eagle, 2, "--layout dflash")


def test_a_new_drafter_takes_the_runs_frozen_shape_and_released_weights(
        target_model: TinyTarget, tmp_path: Path) -> None:
    """The trainer builds the shape run.json froze; a released drafter frozen with
    --init-drafter starts from its weights once their digest is the one frozen at enqueue."""
    from workers.train.drafter.export import export_drafter
    from workers.train.drafter.model import add_mask_token
    from workers.train.drafter.origin import new_drafter
    from workers.train.drafter.target_loader import load_target

    model, tokenizer = load_target(target_model.path)
    mask_id = add_mask_token(tokenizer, model)
    shape = TargetShape.of(model.config)
    drafter = new_drafter(model, mask_id, [1, 3, 5],
                          freeze_origin(str(published(tmp_path)), None, shape))
    assert drafter.config.num_hidden_layers == 2 and drafter.config.block_size == 8
    assert drafter.config.target_layer_ids == (1, 3, 5)

    released = export_drafter(drafter, tmp_path / "released")
    frozen = freeze_origin(None, str(released), shape)
    assert frozen.kind == "init" and frozen.weights_sha256 == weights_digest(released)
    started = new_drafter(model, mask_id, [1, 3, 5], frozen)
    for name, tensor in drafter.state_dict().items():
        assert_close(started.state_dict()[name], tensor, rel=1e-2, what=name)
    weights = released / "model.safetensors"
    weights.write_bytes(weights.read_bytes() + b" ")
    with pytest.raises(DrafterShapeError, match="its weights changed since enqueue"):
        new_drafter(model, mask_id, [1, 3, 5], frozen)


def test_init_drafter_is_checked_and_frozen_with_its_weights_digest_at_enqueue(
        env: dict[str, str], tmp_path: Path, target_model: TinyTarget) -> None:
    """A released drafter: its shape and weights checked (headers only) before anything is
    queued, its directory and weights digest frozen; weights that do not fit are one line."""
    from safetensors.torch import load_file, save_file

    from workers.train.drafter.export import export_drafter
    from workers.train.drafter.model import add_mask_token
    from workers.train.drafter.origin import new_drafter
    from workers.train.drafter.target_loader import load_target

    model, tokenizer = load_target(target_model.path)
    drafter = new_drafter(model, add_mask_token(tokenizer, model), [1, 3, 5],
                          freeze_origin(str(published(tmp_path)), None,
                                        TargetShape.of(model.config)))
    released = export_drafter(drafter, tmp_path / "released")
    ok = cli(env, *ENQUEUE, "--init-drafter", str(released), "--dry-run", "--show", "0",
             "--json")
    assert ok.returncode == 0, ok.stderr
    shown = json.loads(ok.stdout)["drafter"]
    assert shown["kind"] == "init" and shown["path"] == str(released.resolve())
    assert shown["weights_sha256"] == weights_digest(released)
    assert shown["target_layer_ids"] == [1, 3, 5]
    one_error(cli(env, *ENQUEUE, "--init-drafter", str(tmp_path / "nowhere"), "--dry-run"), 2,
              "no config.json")
    weights = released / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["fc.weight"]
    save_file(tensors, str(weights))
    one_error(cli(env, *ENQUEUE, "--init-drafter", str(released), "--dry-run"), 2,
              "weights do not fit", "fc.weight")


def test_a_run_without_a_shape_freezes_the_targets_at_enqueue(env: dict[str, str]) -> None:
    """No --drafter-config/--init-drafter: run.json still freezes the drafter's shape (the
    target's, --drafter-layers deep), so no worker decides it; the train worker takes no shape
    options at all."""
    dry = cli(env, *ENQUEUE, "--drafter-layers", "3", "--dry-run", "--show", "0", "--json")
    assert dry.returncode == 0, dry.stderr
    shown = json.loads(dry.stdout)["drafter"]
    assert shown["kind"] == "default" and shown["name"] == "target"
    assert shown["source"] == "the target's shape, 3 layers (--drafter-layers)"
    assert shown["target_layer_ids"]
    for gone in ("--drafter-config", "--init-drafter"):
        refused = cli(env, "worker", "train", gone, "x")
        assert refused.returncode == 2 and f"No such option '{gone}'" in refused.stderr
    eagle = RunConfig(run="r", model="m", input="x", format="auto", prompt_field=None,
                      shard_size=4, limit=None, layout="eagle3")
    assert RunConfig.from_json(eagle.to_json()) == eagle and eagle.drafter is None


@pytest.mark.e2e
def test_a_run_with_a_frozen_shape_trains_it_on_a_worker_with_another_and_parks_nothing(
        pipeline: Pipeline, tmp_path: Path, target_model: TinyTarget) -> None:
    """The issue's example end to end: the run's config states layers [1, 3, 5]; generation and
    training finish, no shard parks, and the checkpoint, ``status`` and ``export-drafter`` are
    the run's shape from the run's file."""
    from common.runs.checkpoints import committed_steps, load_checkpoint, read_ledger
    from tests.test_generate_e2e import _mt_bench_rows, _write_jsonl
    from tests.test_train_e2e import start_train_worker

    pipeline.env["DFLASH_MODEL"] = target_model.name
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    start_train_worker(pipeline, "trainer")
    pipeline.start_worker("gen")
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(8))
    pipeline.cli("enqueue", "--input", src, "--run", "fz", "--shard-size", "4", "--mode",
                 "online", "--epochs", "1", "--max-new-tokens", "64", "--heldout-min", "0",
                 "--drafter-config",
                 str(published(tmp_path)), check=True)
    wait_until(lambda: sorted(read_ledger(storage, "fz").done) == [0, 1], 300,
               "both shards trained")
    status = pipeline.status("fz")
    assert status["parked"] == [] and status["downstream"]["parked"] == 0, status["parked"]
    assert status["drafter"]["name"] == "qwen-dflash.json"
    state, _ = load_checkpoint(storage, "fz", committed_steps(storage, "fz")[-1])
    assert state["drafter_config"]["num_hidden_layers"] == 2
    assert list(state["drafter_config"]["target_layer_ids"]) == [1, 3, 5]
    out = json.loads(pipeline.cli("export-drafter", "--run", "fz", "--out",
                                  str(tmp_path / "export"), "--json", check=True).stdout)
    assert out["drafter_shape"]["sha256"] == status["drafter"]["sha256"]
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["dflash_config"]["target_layer_ids"] == [1, 3, 5]
