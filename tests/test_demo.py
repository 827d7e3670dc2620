"""The demo (README, docs/getting-started/demo.md), run as a user would: the quick one (80
MT-Bench questions, every turn regenerated) and the whole product on fewer questions (generation
and training side by side, the acceptance length measured, the dataset and the drafter
exported). The quick demo's report figure is the docs' picture of the report."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from common import keys
from common.runs.records import decode_jsonl_zst
from common.storage import open_storage
from producer.demo import free_port
from tests.conftest import MT_BENCH, ROOT, wait_until

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(1800)  # 80 conversations, the report and a rerun, on 2 busy cores
def test_quick_demo_commits_all_80_mt_bench_questions(model_cache: Path,
                                                      tmp_path: Path) -> None:
    out = tmp_path / "demo"
    env = {**os.environ, "DFLASH_CACHE_DIR": str(model_cache), "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "producer.cli", "demo", "--quick", "--no-flower", "--no-ui",
         "--out", str(out), "--max-new-tokens", "128"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "80 samples committed" in result.stdout

    storage = open_storage(str(out / "storage"))
    run = "mt-bench-demo"
    commits = [json.loads(storage.get(k)) for k in storage.list(keys.generated_prefix(run))
               if k.endswith("_COMMIT.json")]
    committed = [i for c in commits for i in c["sample_ids"] + c["rejected_ids"]]
    questions = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    assert sorted(committed) == sorted(str(q["question_id"]) for q in questions)
    assert len(committed) == len(set(committed)) == 80

    from transformers import AutoTokenizer

    from embedded.tinymodel import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model(model_cache))
    by_id = {q["question_id"]: q for q in questions}
    for commit in commits:
        for part in commit["parts"]:
            for sample in decode_jsonl_zst(storage.get(part)):
                if commit["part_of"].get(sample["id"]) != part:
                    continue
                question = by_id[int(sample["id"])]
                users = [m["content"] for m in sample["messages"] if m["role"] == "user"]
                answers = [m for m in sample["messages"] if m["role"] == "assistant"]
                kept, stopped = sample["quality"]["turns_passed"], sample["quality"].get("stopped")
                if not sample["quality"]["passed"]:   # its turn 1 was rejected: only it ran
                    assert users == question["turns"][:1] and len(sample["turns"]) == 1
                    continue
                # Verdicts per turn: a rejected turn 2 ends the conversation, turn 1 kept.
                # The stopped turn's question is in its own prompt, not in the kept history.
                assert users == question["turns"][:kept]
                assert sample["messages"][-1]["role"] == "assistant"
                assert len(answers) == len(sample["turns"]) == kept
                assert kept == 2 or stopped["turn"] == 2
                assert all("reasoning_content" in a and "content" in a for a in answers)
                for turn in sample["turns"]:
                    assert turn["prompt_ids"] and turn["output_ids"]
                    assert turn["finish_reason"] in ("stop", "length")
                assert sample["prompt_ids"] == sample["turns"][-1]["prompt_ids"]
                # Turn by turn: the second prompt holds the target's own first answer.
                second = sample["turns"][1] if kept == 2 else stopped
                second_prompt = tokenizer.decode(second["prompt_ids"])
                assert answers[0]["content"] in second_prompt
                assert question["turns"][1] in second_prompt
                assert sample["finish_reason"] == sample["turns"][-1]["finish_reason"]

    # The demo passes the quality gates; its rejections and their reasons are in the report,
    # whose figure of this real run is the docs site's picture of it (docs/img/report.png).
    assert "quality gates:" in result.stdout
    figure = tmp_path / "report.png"
    report = subprocess.run(
        [sys.executable, "-m", "producer.cli", "report", "--run", run, "--json",
         "--png", str(figure)],
        env={**env, "DFLASH_STORAGE": str(out / "storage")}, cwd=ROOT, capture_output=True,
        text=True, timeout=120,
    )
    assert report.returncode == 0, report.stderr
    data = json.loads(report.stdout)
    assert data["samples"]["total"] == 80 and data["paused"] is None
    assert data["rejection_rate"] < data["gates"]["max_reject_rate"]
    assert sum(data["reasons"].values()) >= data["samples"]["rejected"]
    assert data["supervised_tokens"]["min"] is not None
    assert data["png"] and figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    docs = ROOT / "docs" / "img"
    docs.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(figure, docs / ".report.png.tmp")
    (docs / ".report.png.tmp").replace(docs / "report.png")   # whole, for a concurrent reader

    rerun = subprocess.run(
        [sys.executable, "-m", "producer.cli", "demo", "--quick", "--no-flower", "--no-ui",
         "--out", str(out), "--max-new-tokens", "128"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "0 queued now" in rerun.stdout


# The trainer's own eval kept short; the demo's other settings are its own.
SHORT_TRAIN = {"DFLASH_TRAIN_CHECKPOINT_STEPS": "2", "DFLASH_TRAIN_EVAL_STEPS": "2",
               "DFLASH_TRAIN_EVAL_PROMPTS": "1", "DFLASH_TRAIN_EVAL_MAX_NEW_TOKENS": "8"}


@pytest.mark.timeout(1800)  # the whole product end to end; minutes on 2 busy cores
def test_demo_trains_measures_and_exports_while_generating(model_cache: Path,
                                                           tmp_path: Path) -> None:
    """The demo's full path on 8 questions: the dashboard's URL printed and the run served
    there, its Downstream figures following the trainer; 4 held out, 2 shards trained, the
    acceptance length measured, all exported."""
    questions = MT_BENCH.read_text().splitlines()[:8]
    (tmp_path / "in.jsonl").write_text("\n".join(questions) + "\n")
    out = tmp_path / "demo"
    env = {**os.environ, "DFLASH_CACHE_DIR": str(model_cache), "PYTHONUNBUFFERED": "1",
           **SHORT_TRAIN}
    port = free_port()
    log = tmp_path / "demo.out"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "producer.cli", "demo", "--no-flower", "--out", str(out),
             "--input", str(tmp_path / "in.jsonl"), "--shard-size", "4", "--max-new-tokens",
             "64", "--eval-prompts", "2", "--eval-max-new-tokens", "16", "--ui-port",
             str(port)],
            env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
    try:
        check_dashboard_follows_the_demo(proc, log, port)
        assert proc.wait(timeout=1700) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "8 samples committed" in text and "dflash-pipeline ui" in text
    check_measured_and_exported(text, out, env)


def check_dashboard_follows_the_demo(proc: subprocess.Popen[bytes], log: Path,
                                     port: int) -> None:
    """The printed URL serves the demo's run; its Downstream panel shows a training step."""
    line = wait_until(lambda: re.search(r"Dashboard: (http://\S+)  \(user (\w+), password "
                                        r"(\S+)\)", log.read_text()), 120,
                      "the demo to print the dashboard URL")
    url, user, password = line.groups()
    assert url == f"http://127.0.0.1:{port}/runs/mt-bench-demo"
    token = base64.b64encode(f"{user}:{password}".encode()).decode()

    def status() -> dict | None:
        request = urllib.request.Request(url.replace("/runs/", "/api/runs/") + "/status",
                                         headers={"Authorization": f"Basic {token}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read())
        except OSError:
            return None

    assert wait_until(status, 60, "the dashboard to serve the demo run")["run"] == \
        "mt-bench-demo"

    def training_shown() -> dict | None:   # live, not "hidden 0 / N"
        assert proc.poll() is None, log.read_text()[-3000:]  # the demo still serving
        shown = status()
        return shown["downstream"] if shown and shown["downstream"]["train"].get(
            "step") else None

    down = wait_until(training_shown, 600, "the dashboard to show a training step")
    assert down["mode"] == "online" and down["stage"] == "train"


def check_measured_and_exported(text: str, out: Path, env: dict[str, str]) -> None:
    """The demo's closing lines: tau on the held-out prompts, the dataset and the drafter."""
    import pyarrow.parquet as pq

    from common.runs.checkpoints import read_ledger

    measured = re.search(r"acceptance length tau ([\d.]+) \(pooled [\d.]+\) with drafter step "
                         r"(\d+) on (\d+) held-out prompts.*; lossless (\d+)/(\d+)", text)
    assert measured, text[-3000:]
    tau, step, prompts, exact, checked = measured.groups()
    assert float(tau) >= 1.0 and int(prompts) == int(checked) == 2 and exact == checked
    # More than one epoch by default, the schedule made from the data, tau at each epoch's end.
    epochs = re.search(r"drafter trained (\d+) epoch\(s\), (\d+) steps \(schedule (\d+), "
                       r"finished: schedule\); held-out tau by epoch: ([\d., ]+)", text)
    assert epochs, text[-3000:]
    assert int(epochs[1]) == 3 and epochs[2] == epochs[3]
    assert len(epochs[4].split(", ")) == 3
    # The step measured at the end is the step exported (the best-evaluated one), and the demo
    # says why it took it.
    exported = re.search(r"drafter: \S+  \(step (\d+), ", text)
    assert exported and exported[1] == step, text[-3000:]
    assert re.search(rf"measuring drafter step {step}, the one exported \((best-evaluated: "
                     r"held-out tau [\d.]+ during training|the newest; no held-out tau)", text)

    storage = open_storage(str(out / "storage"))
    run = "mt-bench-demo"
    assert sorted(read_ledger(storage, run).done) == [0, 1]   # every shard trained on
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert "acceptance length tau" in trainer_log                    # measured while training
    # The live record the dashboard's Downstream panel shows: the final step, a measured tau.
    status = json.loads(subprocess.run(
        [sys.executable, "-m", "producer.cli", "status", "--run", run, "--json"],
        env={**env, "DFLASH_STORAGE": str(out / "storage")}, cwd=ROOT, capture_output=True,
        text=True, timeout=120).stdout)
    down = status["downstream"]
    assert down["mode"] == "online" and down["committed"] == 2
    assert int(down["train"]["step"]) == int(epochs[2]) >= int(step) and down["tau"] >= 1.0

    dataset = out / "export" / "dataset"
    assert f"dataset: {dataset}" in text
    splits = {name: sum(pq.read_table(f).num_rows
                        for f in (dataset / "data").glob(f"{name}-*.parquet"))
              for name in ("train", "heldout")}
    shown = re.search(r"\(Parquet, ([\w ,]+) samples;", text)
    assert shown, text[-2000:]
    assert splits == {name: int(n) for name, n in
                      (part.split() for part in shown[1].split(", "))}
    assert 0 < splits["heldout"] <= 4 and splits["train"] > 0  # accepted samples only
    drafter = out / "export" / "drafter"
    assert f"drafter: {drafter}" in text
    config = json.loads((drafter / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert (drafter / "model.safetensors").stat().st_size > 0
