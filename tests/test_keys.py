"""The shard and part names read back to the numbers their templates wrote, and only those."""

from __future__ import annotations

import pytest

from common import key_layout, keys
from common.errors import MalformedName
from common.queue import redis_keys


@pytest.mark.parametrize("shard", [0, 7, 999_999, 1_000_000, 12_345_678])
def test_shard_name_round_trips(shard: int) -> None:
    assert keys.parse_shard_name(keys.shard_name(shard)) == shard
    assert keys.shard_of(keys.generated_commit("r-1", shard)) == shard
    assert keys.shard_of(keys.failed_shard("r", shard, "s", "hidden")) == shard
    owner = redis_keys.lease_owner("w@host", "generate", shard)
    assert redis_keys.lease_shard(redis_keys.lease_token(owner, 30_000)) == shard


@pytest.mark.parametrize("name", ["", "3", "shard-", "shard-12a", "shard--1", "Shard-000001",
                                  "x:shard-000001", "shard-000001 ", "run"])
def test_a_malformed_shard_name_is_named(name: str) -> None:
    with pytest.raises(MalformedName, match="not a shard name"):
        keys.parse_shard_name(name)


def test_a_lease_without_a_shard_reads_as_none() -> None:
    assert redis_keys.lease_shard(None) is None
    assert redis_keys.lease_shard(redis_keys.lease_token("w@host:train:run", 30_000)) is None


def test_a_run_named_like_a_shard_does_not_lend_its_number() -> None:
    assert keys.shard_of(keys.generated_part("myshard-123456", 4, 0)) == 4


@pytest.mark.parametrize("part", [0, 12, 9_999, 10_000])
def test_part_numbers_round_trip(part: int) -> None:
    assert keys.part_number(keys.generated_part("r", 3, part)) == part
    assert keys.part_number(keys.rejected_part("r", 3, part)) == part
    assert keys.part_number(keys.hidden_part("r", 3, part), ".safetensors") == part
    assert keys.part_number(keys.hidden_part("r", 3, part)) is None
    assert keys.part_number(keys.generated_part("r", 3, part), ".safetensors") is None


def test_other_keys_have_no_part_number() -> None:
    for key in (keys.generated_commit("r", 1), keys.hidden_index("r", 1),
                keys.input_shard("r", 1), "runs/r/generated/shard-000001/xpart-0001.jsonl.zst"):
        assert keys.part_number(key) is None
        assert keys.part_number(key, ".safetensors") is None


def _templates(run: str, shard: int) -> dict[str, keys.KeyKind]:
    """One key of each template, with the kind it must read back as."""
    kind = keys.KeyKind
    return {keys.run_config(run): kind.RUN_CONFIG, keys.input_shard(run, shard): kind.INPUT,
            keys.inputs_manifest(run): kind.MANIFEST,
            keys.rejected_input_rows(run, 3): kind.INPUT_ROWS,
            keys.generated_part(run, shard, 2): kind.PART,
            keys.generated_commit(run, shard): kind.COMMIT,
            keys.rejected_part(run, shard, 0): kind.PART,
            keys.gate_event(run, "pause", "20250101T000000.000001-abcdef"): kind.GATE,
            keys.report_png(run, "20250101T000000-abcdef"): kind.REPORT,
            keys.drafter_checkpoint(run, 40, "state.pt"): kind.CHECKPOINT,
            keys.drafter_checkpoint(run, 40, "_COMMIT.json", 2): kind.CHECKPOINT,
            keys.drafter_latest(run): kind.LATEST,
            keys.failed_shard(run, shard, "20250101T000000-abcdef"): kind.FAILED,
            keys.failed_shard(run, shard, "20250101T000000-abcdef", "train"): kind.FAILED,
            keys.index_object(run, "digests", shard // 100, 7, "0123abcd"): kind.INDEX,
            keys.hidden_part(run, shard, 1): kind.PART, keys.hidden_index(run, shard):
            kind.HIDDEN_INDEX, keys.hidden_commit(run, shard): kind.COMMIT,
            keys.access_probe("drafter"): kind.PROBE,
            keys.doctor_probe("index", "0" * 32): kind.PROBE}


@pytest.mark.parametrize("shard", [0, 123, 1_000_000])
def test_every_template_reads_back_as_its_kind(shard: int, caplog) -> None:
    for key, kind in _templates("run-1.a_b", shard).items():
        found = keys.parse(key)
        assert found is not None and found.kind is kind, key
    assert "ignoring storage key" not in caplog.text


# Keys another stage's key could write through a grant whose `*` crosses a `/` (issue 53), and
# keys whose digits or names no template writes: none is a step, a commit, a part or an index.
FORGED = ["runs/r/drafter/index/step-000999/_COMMIT.json",
          "runs/r/generated/shard-000001/drafter/_COMMIT.json",
          "runs/r/generated/shard-000001/index/part-0001.jsonl.zst",
          "runs/r/hidden/shard-000001/drafter/_COMMIT.json",
          "runs/r/index/digests/x/chunk-0000-003-0123abcd.json.zst",
          "runs/r/drafter/step-0999/_COMMIT.json", "runs/r/drafter/step-000999.0/_COMMIT.json",
          "runs/r/drafter/step-000999.01/_COMMIT.json", "runs/r/generated/shard-1/_COMMIT.json",
          "runs/r/generated/shard-0000001/_COMMIT.json", "runs/r/generated/shard-000001/"
          "part-1.jsonl.zst", "runs/..x/generated/shard-000001/_COMMIT.json",
          "runs/r/generated/_COMMIT.json", "runs/r/inputs/x/shard-000001.jsonl.zst",
          "runs/r/gates/x/pause-1.json", "runs/r/drafter/step-000001/other.bin",
          "x/runs/r/generated/shard-000001/_COMMIT.json"]


@pytest.mark.parametrize("key", FORGED)
def test_a_key_of_no_layout_is_ignored_and_logged_once(key: str, caplog, monkeypatch) -> None:
    monkeypatch.setattr(key_layout, "_IGNORED", set())   # once per process: start afresh
    assert keys.parse(key) is None
    assert keys.shard_of(key) is None and keys.commit_shard(key) is None
    assert keys.checkpoint_id(key) is None and keys.index_entry(key) is None
    assert keys.part_number(key) is None and keys.input_shard_of(key) is None
    assert caplog.text.count(key) == 1 and "not a key of the pipeline's layout" in caplog.text
