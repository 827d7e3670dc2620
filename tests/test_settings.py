"""Settings and per-command options declared once: their sections, the ``DFLASH_*`` variable of
each (binding: users set them), ``--help`` naming them, one-line errors, the device resolver."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator

import click
import pytest
import torch
from click.testing import CliRunner

from common.cli.options import OPTIONS
from common.config import FIELDS, SECTIONS, Settings, env_name, load_settings
from common.errors import ConfigError
from producer.cli import main
from tests.conftest import ROOT
from workers.devices import resolve_device

# Every setting's section and variable, written out: a rename that changes a variable fails here.
SETTINGS = {
    "broker": "BROKER_URL STORAGE VISIBILITY_TIMEOUT RESULT_EXPIRES SOFT_SHUTDOWN_TIMEOUT",
    "worker": "LEASE_TTL MAX_DELIVERIES RETRY_BACKOFF_MAX GPU METRICS_PORT METRICS_HOST",
    "target": "MODEL CACHE_DIR ENGINE_DIR",
    "generate": "PART_SAMPLES PART_SECONDS BATCH_SIZE ENGINE ENGINE_URL ENGINE_CMD ENGINE_ARGS MTP "
                "MTP_SWITCH_DWELL MTP_MEASURE_WINDOW MTP_MARGIN ENGINE_PYTHON ENGINE_PORT TP "
                "MEM_FRACTION_STATIC MAX_IN_FLIGHT ENGINE_STARTUP_TIMEOUT ENGINE_DRAIN_TIMEOUT "
                "REQUEST_TIMEOUT",
    "hidden": "HIDDEN_BATCH_TOKENS HIDDEN_DEVICE HIDDEN_PART_BYTES",
    "train": "TRAIN_CHECKPOINT_STEPS TRAIN_ROWS_PER_STEP TRAIN_TOTAL_STEPS "
             "TRAIN_MIN_SUPERVISED_TOKENS TRAIN_MAX_ANCHORS TRAIN_BATCH_TOKENS "
             "TRAIN_ACTIVATION_CHECKPOINTING TRAIN_MEMORY_MARGIN TRAIN_EVAL_STEPS "
             "TRAIN_EVAL_PROMPTS TRAIN_EVAL_MAX_NEW_TOKENS TRAIN_DEVICE TRAIN_NPROC_PER_NODE "
             "TRAIN_NNODES TRAIN_NODE_RANK TRAIN_RDZV_ENDPOINT TRAIN_PARALLEL TENSORBOARD_DIR",
    "read": "READ_JSON_BYTES READ_INDEX_BYTES READ_INDEX_DECODED_BYTES READ_PART_BYTES "
            "READ_PART_DECODED_BYTES READ_PART_ROWS READ_ROW_BYTES",
    "ui": "UI_AUTH UI_ENGINE_NETWORKS",
}
COMMAND_OPTIONS = (
    "VERBOSE RUN FORMAT PROMPT_FIELD PROMPT_TEMPLATE STRICT_FIELDS SHARD_SIZE LIMIT MODE LAYOUT "
    "HELDOUT_FRACTION HELDOUT_MIN EPOCHS MAX_TRAIN_TOKENS MAX_TURNS PATIENCE INPUT MAX_NEW_TOKENS "
    "TEMPERATURE TOP_P TOP_K MIN_P REPETITION_PENALTY PRESENCE_PENALTY THINKING NO_THINKING "
    "CHAT_TEMPLATE_KWARGS TARGET_LAYERS DRAFTER_LAYERS DRAFTER_CONFIG INIT_DRAFTER "
    "MIN_SUPERVISED_TOKENS MAX_REJECT_RATE PAUSE_AFTER MIN_ANSWER_TOKENS SKIP_GATE REPORT_JSON "
    "REPORT_PNG REPORT_NO_PNG UI_HOST UI_PORT LOGLEVEL WORKER_NAME CONCURRENCY"
)


def test_every_setting_derives_its_variable_from_its_section_and_name() -> None:
    derived = {section: [] for section in SECTIONS}
    for flat, (section, _) in FIELDS.items():
        derived[section].append(env_name(flat))
    assert derived == {s: [f"DFLASH_{v}" for v in names.split()] for s, names in SETTINGS.items()}


def test_every_command_option_derives_its_variable() -> None:
    assert [env_name(flat) for flat in OPTIONS] == [f"DFLASH_{v}" for v in COMMAND_OPTIONS.split()]
    assert not OPTIONS.keys() & FIELDS.keys(), "one name, one declaration"


def test_settings_are_read_by_section_and_flat_names_only_name_variables() -> None:
    settings = load_settings({"DFLASH_HIDDEN_DEVICE": "cpu", "DFLASH_TRAIN_NODE_RANK": "0",
                              "DFLASH_TENSORBOARD_DIR": "/tb"}, model="m")
    assert settings.hidden.device == "cpu"
    assert settings.train.device == "auto", "train has its own device, not hidden's"
    assert settings.train.tensorboard_dir == "/tb" and settings.target.model == "m"
    moved = dataclasses.replace(settings, model="other", train_nnodes=2)
    assert (moved.target.model, moved.train.nnodes, moved.hidden.device) == ("other", 2, "cpu")
    assert Settings(train_nproc_per_node=8).train.nproc_per_node == 8
    with pytest.raises(TypeError, match="nonsense"):
        Settings(nonsense=1)
    for flat in ("hidden_device", "model", "lease_ttl", "train_rows_per_step", "nonsense"):
        with pytest.raises(AttributeError):
            getattr(settings, flat)   # one way to read a setting: by its section


def test_secrets_and_broker_passwords_stay_masked_in_repr() -> None:
    shown = repr(load_settings({"DFLASH_UI_AUTH": "me:hunter2",
                                "DFLASH_BROKER_URL": "redis://:s3cret@h:1/0"}))
    assert "hunter2" not in shown and "s3cret" not in shown and "ui_auth='***'" in shown


def test_secret_flags_in_an_engine_command_stay_masked_in_repr() -> None:
    """An engine command or extra flags carrying SGLang's --api-key: the worker logs its
    settings at start, and the key must not reach the log."""
    shown = repr(load_settings({"DFLASH_ENGINE_CMD": "python -m sim --api-key sesame --port 1",
                                "DFLASH_ENGINE_ARGS": "--admin-api-key=zz --tp 2"}))
    assert "sesame" not in shown and "zz" not in shown
    assert "--api-key *** --port 1" in shown and "--admin-api-key=*** --tp 2" in shown


def _options(group: click.Group) -> Iterator[tuple[str, click.Option]]:
    for name in group.list_commands(click.Context(group)):
        command = group.get_command(click.Context(group), name)
        if isinstance(command, click.Group):
            yield from ((f"{name} {sub}", o) for sub, o in _options(command))
        else:
            yield from ((name, p) for p in command.params if isinstance(p, click.Option))


def test_every_variable_the_cli_reads_is_declared() -> None:
    declared = {env_name(flat) for flat in (*FIELDS, *OPTIONS)}
    read = {(command, o.name, o.envvar) for command, o in _options(main) if o.envvar}
    assert read and {v for _, _, v in read} <= declared
    assert ("enqueue", "run", "DFLASH_RUN") in read
    assert ("report", "as_json", "DFLASH_REPORT_JSON") in read
    assert ("ui", "host", "DFLASH_UI_HOST") in read


def test_help_names_each_variable() -> None:
    runner = CliRunner()
    shown = runner.invoke(main, ["enqueue", "--help"], terminal_width=200).output
    for variable in ("DFLASH_RUN", "DFLASH_INPUT", "DFLASH_SHARD_SIZE", "DFLASH_FORMAT",
                     "DFLASH_HELDOUT_MIN", "DFLASH_MAX_REJECT_RATE", "DFLASH_MODEL",
                     "DFLASH_STORAGE", "DFLASH_BROKER_URL"):
        assert variable in shown
    assert "[env var: DFLASH_SHARD_SIZE; default: 256; x>=1]" in shown
    for command in ("resume", "status", "report", "ui", "plan-storage", "export-dataset",
                    "export-drafter", "eval-drafter", "bench"):
        shown = runner.invoke(main, [*command.split(), "--help"], terminal_width=200).output
        named = [o.envvar for c, o in _options(main) if c == command and o.envvar and o.show_envvar]
        assert named and all(v in shown for v in named), command


def test_defaults_come_from_the_declarations() -> None:
    options = {(c, o.name): o for c, o in _options(main)}
    assert options["enqueue", "shard_size"].default == OPTIONS["shard_size"].default
    assert options["enqueue", "thinking"].default is OPTIONS["thinking"].default
    assert options["ui", "port"].default == OPTIONS["ui_port"].default


def test_a_bad_variable_is_one_line_naming_it() -> None:
    env = {**os.environ, "DFLASH_LEASE_TTL": "-1"}
    result = subprocess.run([sys.executable, "-m", "producer.cli", "status", "--run", "r"],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == "error: DFLASH_LEASE_TTL='-1' must be positive"
    result = CliRunner().invoke(main, ["status", "--run", "r"], env={"DFLASH_HIDDEN_DEVICE": "gpu"})
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "error: DFLASH_HIDDEN_DEVICE='gpu' is not a device: auto, cpu, cuda, cuda:N or mps"]


def test_one_device_resolver() -> None:
    cuda = torch.cuda.is_available()
    assert resolve_device("auto") == torch.device("cuda" if cuda else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="DFLASH_TRAIN_DEVICE='gpu0' is not a device"):
        resolve_device("gpu0", "DFLASH_TRAIN_DEVICE")
    if not cuda:
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda:1")
