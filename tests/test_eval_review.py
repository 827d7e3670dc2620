"""Issue 67's review: export-drafter's checkpoint choice against forged commits, and
``eval-drafter``'s hostile options (concurrency levels, sets named twice, stored records)."""

from __future__ import annotations

import io
import json
import tracemalloc
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from common import keys
from common.drafter.shape import DrafterShapeError
from common.errors import ConfigError, NotFound
from common.runs.checkpoints import Ledger, best_step, readable_commits, save_checkpoint
from common.runs.evals import newest_eval, render_table, write_eval
from common.runs.records import dumps
from common.runs.schema import CHECKPOINT_SCHEMA
from common.runs.schemas import EVAL_RECORD
from common.storage import LocalStorage
from common.storage_api import StoredObject
from producer.report_evals import eval_lines
from tests.conftest import TinyTarget
from workers.train.commands import checkpoint_state
from workers.train.eval_serving import MAX_LEVEL, check_levels, parse_levels
from workers.train.eval_sets import parse_datasets

RUN = "rv"


def _forged_commit(storage: LocalStorage, step: int, metrics: Mapping[str, object],
                   state: bytes | None = None, run: str = RUN, size: int = 100) -> None:
    """A schema-valid commit at ``step`` (train's key may write one anywhere under drafter/),
    with ``state`` put beside it when given."""
    if state is not None:
        storage.put_once(keys.drafter_checkpoint(RUN, step, "state.pt"), state)
        size = len(state)
    commit = {"run": run, "step": step, "seq": 0, "ledger": Ledger(epoch=9).to_json(),
              "metrics": dict(metrics), "bytes": size, "schema": CHECKPOINT_SCHEMA}
    assert storage.put_once(keys.drafter_checkpoint(RUN, step, "_COMMIT.json"), dumps(commit))


def _honest(tmp_path: Path) -> LocalStorage:
    storage = LocalStorage(str(tmp_path))
    save_checkpoint(storage, RUN, 2, {"step": 2}, Ledger(epoch=1),
                    {"tau_step": "2", "tau": "1.5"})   # Redis' text, as the trainer stores it
    return storage


def test_a_commit_with_no_state_or_of_another_run_never_chooses_the_export(
        tmp_path: Path) -> None:
    storage = _honest(tmp_path)
    honest = storage.get(keys.drafter_checkpoint(RUN, 2, "state.pt"))
    _forged_commit(storage, 4, {"tau_step": 4, "tau": 9.0})                 # no state at all
    _forged_commit(storage, 8, {"tau_step": 8, "tau": 10.0}, honest, run="other")
    assert best_step(storage, RUN) == (2, 1.5)
    assert [step for (step, _), _ in readable_commits(storage, RUN)] == [4, 2]
    assert checkpoint_state(storage, RUN, None)["step"] == 2


def test_a_best_step_whose_state_does_not_load_falls_back_to_the_newest_that_does(
        tmp_path: Path) -> None:
    storage = _honest(tmp_path)
    _forged_commit(storage, 6, {"tau_step": 6, "tau": 8.0}, b"\0" * 64)   # the size it states
    assert best_step(storage, RUN) == (6, 8.0)       # proven by its listing, not yet loaded
    assert checkpoint_state(storage, RUN, 6, newest_else=True)["step"] == 2
    with pytest.raises(NotFound, match="at step 6 that loads"):
        checkpoint_state(storage, RUN, 6)              # asked for: said, never another step


def test_metrics_that_are_no_numbers_choose_nothing(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    for step, metrics in ((2, {"tau_step": "abc", "tau": "1.0"}),
                          (4, {"tau_step": 4, "tau": "nan"}),
                          (6, {"tau_step": True, "tau": 3.0}),
                          (8, {"tau_step": [8], "tau": {"x": 1}})):
        buffer = io.BytesIO()
        torch.save({"step": step, "ledger": Ledger().to_json()}, buffer)
        storage.put_once(keys.drafter_checkpoint(RUN, step, "state.pt"), buffer.getvalue())
        _forged_commit(storage, step, metrics, buffer.getvalue())
    assert best_step(storage, RUN) is None
    assert checkpoint_state(storage, RUN, None)["step"] == 8


def test_no_loadable_checkpoint_is_one_not_found(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    _forged_commit(storage, 4, {})
    with pytest.raises(NotFound, match="no drafter checkpoint that loads"):
        checkpoint_state(storage, RUN, None)


@pytest.mark.parametrize("value", ["0", "a", "1,,8", "", ",", "-1", str(MAX_LEVEL + 1),
                                   "9" * 40, "1.5"])
def test_concurrency_levels_out_of_form_are_one_error(value: str) -> None:
    with pytest.raises(ConfigError, match="--concurrency"):
        parse_levels(value)


def test_concurrency_levels_in_form() -> None:
    assert parse_levels("32, 1,8,8") == [1, 8, 32]
    assert parse_levels(str(MAX_LEVEL)) == [MAX_LEVEL]


def test_a_set_named_twice_is_refused(tmp_path: Path) -> None:
    one, other = tmp_path / "a" / "gsm.jsonl", tmp_path / "b" / "gsm.jsonl"
    for path in (one, other):
        path.parent.mkdir()
        path.write_text('{"prompt": "x"}\n')
    with pytest.raises(ConfigError, match="'gsm8k' named more than once"):
        parse_datasets(["gsm8k=a.jsonl", "gsm8k=b.jsonl"])
    with pytest.raises(ConfigError, match="'gsm' named more than once"):
        parse_datasets([str(one), str(other)])
    assert [s.name for s in parse_datasets(["gsm8k=a.jsonl", str(one)])] == ["gsm8k", "gsm"]


def _tampered(real: dict[str, Any]) -> dict[str, Callable[[dict[str, Any]], None]]:
    """Changes that keep the schema but not what write_eval writes at the key."""
    def row(rec: dict[str, Any]) -> dict[str, Any]:
        return next(iter(rec["datasets"].values()))

    def set_name(rec: dict[str, Any]) -> None:
        rec["datasets"]["gsm8k\nerror: forged"] = rec["datasets"].pop(next(iter(
            rec["datasets"])))

    def level_zero(rec: dict[str, Any]) -> None:
        row(rec)["concurrency"]["0"] = row(rec)["concurrency"].pop("1")

    return {
        "negative tau": lambda rec: row(rec).update(spec_accept_length=-3.0),
        "negative speedup": lambda rec: next(iter(row(rec)["concurrency"].values())).update(
            speedup=-1.0),
        "a set name over two lines": set_name,
        "a stamp of another key": lambda rec: rec.update(stamp=rec["stamp"] + "\nx"),
        "a drafter name over two lines": lambda rec: rec["drafter"].update(name="a\rb"),
        "level 0": level_zero,
        "more mismatches than checked": lambda rec: row(rec).update(lossless={
            "checked": 1, "mismatches": [{"prompt": "p"}] * 3}),
    }


def test_a_schema_valid_eval_record_not_as_written_is_passed_over(tmp_path: Path) -> None:
    from tests.test_report_eval import result

    storage = LocalStorage(str(tmp_path))
    real_key = write_eval(storage, RUN, result(), 7, None)
    real = json.loads(storage.get(real_key))
    for n, (what, change) in enumerate(_tampered(real).items()):
        record = json.loads(json.dumps(real))
        stamp = f"99991231T000000.{n:06d}-ffffff"   # newer than the real one
        record["stamp"] = stamp
        change(record)
        EVAL_RECORD.validate_python(record)           # the schema takes it: only proof refuses
        storage.put_once(keys.eval_record(RUN, stamp), json.dumps(record).encode())
        found = newest_eval(storage, RUN)
        assert found is not None and found["key"] == real_key, what
        assert len(found["skipped"]) == n + 1, what
    lines = eval_lines(newest_eval(storage, RUN))
    assert not any(line.startswith("error:") for line in lines)
    assert len(render_table(real).splitlines()) + 1 + len(_tampered(real)) == len(lines)


def test_a_level_above_a_sets_prompts_is_said() -> None:
    assert check_levels({"gsm8k": 8, "mt-bench": 80}, [1, 8]) == []
    said = check_levels({"gsm8k": 8, "mt-bench": 80}, [1, 8, 32])
    assert len(said) == 1 and "set gsm8k has 8 prompts" in said[0]
    assert "those of concurrency 8" in said[0]


def test_a_prompt_file_whose_stem_is_no_set_name_is_refused(tmp_path: Path) -> None:
    for stem in ("two\nlines", "x" * 201):
        path = tmp_path / f"{stem}.jsonl"
        path.write_text('{"prompt": "x"}\n')
        with pytest.raises(ConfigError, match="rename the file"):
            parse_datasets([str(path)])


def test_a_tensor_in_two_weight_files_is_one_line(target_model: TinyTarget,
                                                  tmp_path: Path) -> None:
    """SpecForge's shards beside a stale single file: every tensor twice, which one would
    serve is a guess (was: the single file's, silently)."""
    from safetensors.torch import save_file

    from tests.test_eval_published import drafter_for, specforge_dir, weights
    from workers.train.drafter.export import load_drafter

    target, tokenizer, drafter = drafter_for(target_model.path)
    both = specforge_dir(drafter, tmp_path / "sf")
    save_file({k: v + 1 for k, v in weights(drafter).items()}, str(both / "model.safetensors"))
    with pytest.raises(DrafterShapeError, match="is in model.safetensors and in another") as e:
        load_drafter(both, target, tokenizer=tokenizer)
    assert "\n" not in str(e.value)


ISSUE_KEYS = {"prompts", "tokens", "tau", "tau_pooled", "spec_accept_length", "by_position",
              "lossless", "tokens_per_s", "speedup", "concurrency"}   # issue 67's fixed JSON


def test_both_modes_give_issue_67s_keys_and_null_where_they_cannot_measure() -> None:
    from workers.train.drafter.specdec import Decoded
    from workers.train.eval_table import DEFINITION, local_entry, served_entry

    decoded = [Decoded([1] * 9, 4, [3, 3, 2])]
    local = local_entry(decoded, {"prompts": 1, "tokens": 9, "tau": 2.667, "tau_pooled": 2.667,
                                  "lossless": {"checked": 1, "mismatches": []}})
    level = {"tokens": 9, "seconds": 1.0, "tokens_per_s": 9.0, "spec_accept_length": 3.0,
             "spec_verify_ct": 3, "baseline_tokens_per_s": 4.5, "speedup": 2.0}
    served = served_entry(1, {8: level, 1: level})
    for entry in (local, served):
        assert set(entry) == ISSUE_KEYS and set(DEFINITION) >= ISSUE_KEYS - {"prompts", "tokens"}
        assert list(entry["by_position"]) == ["0-1k", "1k-4k", "4k-16k", "16k+"]
    assert local["spec_accept_length"] == 3.0 and local["by_position"]["0-1k"] == 2.6667
    assert (local["tokens_per_s"], local["speedup"], local["concurrency"]) == (None,) * 3
    assert (served["tau"], served["tau_pooled"], served["lossless"]) == (None,) * 3
    assert list(served["concurrency"]) == ["1", "8"] and served["speedup"] == 2.0


def test_a_repository_copy_reads_the_hub_config_only(tmp_path: Path) -> None:
    """openai/gsm8k ships main/ and socratic/, mbpp full/ and sanitized/: a copy of the whole
    repository reads the config the hub fetch reads, never both as one set."""
    from workers.train.eval_sets import read_set

    for config, rows in (("main", ["m1", "m2"]), ("socratic", ["s1", "s2", "s3"])):
        (tmp_path / "gsm8k" / config).mkdir(parents=True)
        (tmp_path / "gsm8k" / config / "test.jsonl").write_text(
            "".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in rows))
    read = read_set("gsm8k", str(tmp_path / "gsm8k"), 100)
    assert [p.text.split("\n")[0] for p in read] == ["m1", "m2"]
    for config, field in (("full", "text"), ("sanitized", "prompt")):
        (tmp_path / "mbpp" / config).mkdir(parents=True)
        (tmp_path / "mbpp" / config / "test.jsonl").write_text(
            json.dumps({"task_id": 11, field: f"{config} task"}) + "\n")
    assert [p.text for p in read_set("mbpp", str(tmp_path / "mbpp"), 100)] == ["sanitized task"]


class _Flooded(LocalStorage):
    """A real store whose evals/ listing also streams ``extra`` older records' entries (a run
    flooded with eval records; their bodies are never read: only the newest few are)."""

    def __init__(self, root: str, extra: int) -> None:
        super().__init__(root)
        self.extra = extra

    def list_objects(self, prefix: str, start_after: str = "") -> Iterator[StoredObject]:
        yield from super().list_objects(prefix, start_after)
        if prefix == keys.evals_prefix(RUN):
            for n in range(self.extra):
                yield StoredObject(keys.eval_record(RUN, f"20000101T000000.{n:06d}-000000"),
                                   100, "0" * 32, 1.0 + n * 1e-6)


def test_a_run_with_many_eval_records_is_read_newest_first_in_bounded_memory(
        tmp_path: Path) -> None:
    from tests.test_report_eval import result

    storage = _Flooded(str(tmp_path), 100_000)
    real_key = write_eval(storage, RUN, result(), 7, None)
    tracemalloc.start()
    try:
        found = newest_eval(storage, RUN)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert found is not None and found["key"] == real_key and found["skipped"] == []
    assert peak < 4 * 2**20, f"{peak / 2**20:.1f} MiB held while listing 100,000 records"
