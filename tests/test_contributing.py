"""docs/contributing.md's examples hold: a worker setting's one declaration reaches its command's
--help, its DFLASH_ variable and the settings reference; a run option's reaches run.json, its
schema, --help and the stage that uses it, and a run.json written before the option reads on."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from common.runs.json_schema import run_json_schema
from common.runs.options import FrozenOptions
from common.runs.records import RunConfig
from tests.conftest import ROOT, Pipeline
from tests.test_generate_e2e import _committed_samples, _mt_bench_rows, _write_jsonl

PAGE = (ROOT / "docs" / "contributing.md").read_text()


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE, re.S)


def test_the_pages_code_is_the_codes() -> None:
    setting, setting_use, declaration, use = _blocks()[:4]
    assert setting in (ROOT / "common" / "config_sections.py").read_text()
    assert setting_use in (ROOT / "workers" / "train" / "periodic_eval.py").read_text()
    assert declaration in (ROOT / "common" / "runs" / "options.py").read_text()
    assert use in (ROOT / "workers" / "generate" / "regeneration.py").read_text()


def test_one_setting_declaration_reaches_help_its_variable_and_the_reference() -> None:
    from click.testing import CliRunner

    from common.config import FIELDS, load_settings
    from common.declared import declared
    from producer.cli import main

    _, f = FIELDS["train_eval_prompts"]
    found = declared(f)
    assert found is not None and found.commands == ("worker train",)
    shown = CliRunner().invoke(main, ["worker", "train", "--help"], terminal_width=200).output
    line = next(x for x in shown.splitlines() if x.strip().startswith("--eval-prompts"))
    assert found.help in line and "DFLASH_TRAIN_EVAL_PROMPTS" in line and "default: (8)" in line
    other = CliRunner().invoke(main, ["worker", "hidden", "--help"], terminal_width=200).output
    assert "--eval-prompts" not in other, "only the commands the declaration names take it"
    assert load_settings({"DFLASH_TRAIN_EVAL_PROMPTS": "16"}).train.eval_prompts == 16
    result = CliRunner().invoke(main, ["worker", "train", "--eval-prompts", "0"])
    assert result.exit_code == 2 and "x>=1" in result.output   # an int setting is >= 1
    from tests.test_docs import load

    row = re.search(r"^\| `train_eval_prompts` \| `DFLASH_TRAIN_EVAL_PROMPTS` \| `8` \| "
                    r"`--eval-prompts` \(worker train\) \| (.*) \|$",
                    load("references").settings_markdown(), re.M)
    assert row is not None and row.group(1) == found.help


def test_one_declaration_reaches_help_schema_and_the_record() -> None:
    assert "max_turns" in {f.name for f in fields(FrozenOptions)}
    assert "max_turns" in run_json_schema()["properties"]
    shown = subprocess.run([sys.executable, "-m", "producer.cli", "enqueue", "--help"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert "--max-turns" in shown.stdout and "DFLASH_MAX_TURNS" in shown.stdout
    config = RunConfig(run="r", model="m", input="x", max_turns=2)
    assert config.to_json()["max_turns"] == 2


def test_an_older_run_json_reads_as_the_default() -> None:
    older = RunConfig(run="r", model="m", input="x").to_json()
    del older["max_turns"]   # written before the option existed
    read = RunConfig.from_json(older)
    assert read.max_turns is None
    read.check_same(RunConfig(run="r", model="m", input="x", created_at=read.created_at))


@pytest.mark.e2e
def test_the_stage_generates_only_the_turns_asked_for(pipeline: Pipeline,
                                                      tmp_path: Path) -> None:
    rows = _mt_bench_rows(4)
    assert all(len(r["turns"]) == 2 for r in rows), "MT-Bench rows have two turns"
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    pipeline.start_worker("gen")
    pipeline.cli("enqueue", "--input", src, "--run", "mt", "--shard-size", "4",
                 "--max-new-tokens", "48", "--max-turns", "1", "--skip-gate", "truncated",
                 check=True)
    pipeline.wait_done("mt")
    samples = _committed_samples(pipeline.env["DFLASH_STORAGE"], "mt")
    assert samples and all(len(s["turns"]) == 1 for s in samples), \
        [len(s["turns"]) for s in samples]
