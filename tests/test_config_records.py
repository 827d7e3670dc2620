"""Settings from the environment, secret masking, and the frozen run config's diff."""

from __future__ import annotations

import pytest

from common.config import load_settings, mask_url
from common.errors import ConfigError, RunConfigMismatch
from common.runs.records import RunConfig, Sampling


def test_env_is_read_and_overrides_win() -> None:
    env = {"DFLASH_BROKER_URL": "redis://:pw@h:1/0", "DFLASH_LEASE_TTL": "7.5",
           "DFLASH_PART_SAMPLES": "3"}
    settings = load_settings(env, storage="/x")
    assert settings.worker.lease_ttl == 7.5 and settings.generate.part_samples == 3
    assert settings.broker.storage == "/x"


def test_bad_env_values_name_the_variable() -> None:
    with pytest.raises(ConfigError, match="DFLASH_PART_SAMPLES"):
        load_settings({"DFLASH_PART_SAMPLES": "many"})
    with pytest.raises(ConfigError, match="positive"):
        load_settings({"DFLASH_LEASE_TTL": "-1"})


def test_broker_password_never_shown() -> None:
    settings = load_settings({"DFLASH_BROKER_URL": "redis://user:s3cret@redis:6379/0"})
    assert "s3cret" not in repr(settings)
    assert "s3cret" not in settings.masked_broker_url
    assert mask_url("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert mask_url("redis://redis:6379/0") == "redis://redis:6379/0"


@pytest.mark.parametrize(("url", "secret", "shown"), [
    ("redis://:pa@ss@host:6379/0", "ss", "redis://:***@host:6379/0"),   # a raw "@" in it
    ("redis://dash:p:w@d/x@redis:6379/0", "d/x", "redis://dash:***@redis:6379/0"),
    ("rediss://token@redis:6380", "token", "rediss://***@redis:6380"),   # no user name
    ("cannot reach redis://:a@b@h:1/0 (ask ops@example.com)", "a@b", "redis://:***@h:1/0 "),
])
def test_mask_url_hides_the_whole_userinfo(url: str, secret: str, shown: str) -> None:
    masked = mask_url(url)
    assert secret not in masked and shown in masked, masked


def _config(**kw: object) -> RunConfig:
    base = dict(run="r", model="m", input="/in.jsonl", format="auto", prompt_field=None,
                shard_size=8, limit=None)
    return RunConfig(**{**base, **kw})


def test_run_config_diff_names_fields_and_ignores_timestamps() -> None:
    a = _config()
    b = _config(shard_size=9, sampling=Sampling(max_new_tokens=7))
    assert a.differences(_config()) == []
    assert a.differences(b) == ["sampling.max_new_tokens", "shard_size"]
    with pytest.raises(RunConfigMismatch, match="shard_size"):
        a.check_same(b)
    assert RunConfig.from_json(b.to_json()) == b


def test_a_run_stored_before_an_added_option_reads_on_with_its_default() -> None:
    """run.json written before --max-train-tokens existed: the field is missing, it reads as
    whole rows (None), and enqueueing the same run again is no mismatch; no schema bump."""
    stored = _config().to_json()
    del stored["max_train_tokens"]
    old = RunConfig.from_json(stored)
    assert old.max_train_tokens is None and old.schema == _config().schema
    assert old.differences(_config()) == []
    assert _config(max_train_tokens=4096).differences(old) == ["max_train_tokens"]
