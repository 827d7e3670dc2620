"""The shard and part names read back to the numbers their templates wrote, and only those."""

from __future__ import annotations

import pytest

from common import keys, redis_keys
from common.errors import MalformedName


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
