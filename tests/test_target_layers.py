"""``--target-layers``: K as before, explicit ids, named strategies; checked against the target."""

from __future__ import annotations

import pytest

from common.drafter.layers import dflash_layer_ids, resolve_target_layers, spread
from common.engine.target import TargetShape
from common.errors import ConfigError, SchemaMismatch
from common.runs.records import RunConfig
from common.runs.schema import RUN_SCHEMA


def shape(layers: int, hybrid: bool) -> TargetShape:
    types = [("full_attention" if (i + 1) % 4 == 0 or not hybrid else "linear_attention")
             for i in range(layers)]
    return TargetShape.from_dict({"model_type": "qwen3_5_text" if hybrid else "qwen3",
                                  "hidden_size": 64, "num_hidden_layers": layers,
                                  "vocab_size": 100, "layer_types": types})


def test_an_int_is_the_dflash_spread_as_before() -> None:
    dense = shape(36, hybrid=False)
    assert resolve_target_layers(5, dense) == dflash_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert resolve_target_layers("3", dense) == dflash_layer_ids(36, 3)
    assert resolve_target_layers(None, dense) == dflash_layer_ids(36, 5)     # dense default
    assert resolve_target_layers("dflash:4", dense) == dflash_layer_ids(36, 4)


def test_named_strategies_read_the_layer_kinds() -> None:
    hybrid = shape(64, hybrid=True)           # Qwen3.6-27B: full attention at 3, 7, ..., 63
    assert hybrid.full_attention_layers[:3] == [3, 7, 11]
    assert resolve_target_layers("full-attention", hybrid) == [3, 19, 35, 47, 63]
    assert resolve_target_layers("full-attention:2", hybrid) == [3, 63]
    assert resolve_target_layers("after-full", hybrid) == [4, 20, 32, 44, 60]
    tiny = shape(8, hybrid=True)
    assert resolve_target_layers("full-attention", tiny) == [3, 7]
    assert resolve_target_layers("after-full", tiny) == [4]      # nothing after the last layer
    assert resolve_target_layers("1, 4,6", tiny) == [1, 4, 6]
    assert resolve_target_layers(None, tiny) == resolve_target_layers("after-full", tiny)


@pytest.mark.parametrize(("spec", "words"), [
    ("0,8", "layer ids [8] outside the target's 0..7"),
    ("2,2", "named twice"),
    ("middle", "unknown target layers 'middle'"),
    ("full-attention:0", "unknown target layers"),
    ("9", "needs at least 5"),
])
def test_bad_specs_are_one_clear_error(spec: str, words: str) -> None:
    small = shape(8, hybrid=True) if spec != "9" else shape(4, hybrid=False)
    with pytest.raises(ConfigError, match="--target-layers") as err:
        resolve_target_layers(spec, small)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_layer_kind_strategies_need_a_hybrid() -> None:
    with pytest.raises(ConfigError, match="no linear-attention layers"):
        resolve_target_layers("after-full", shape(12, hybrid=False))


def test_spread_and_a_run_file_of_another_schema() -> None:
    assert spread([3, 7, 11, 15], 2) == [3, 15] and spread([3, 7], 5) == [3, 7]
    written = RunConfig(run="r", model="m", input="i", format="auto", prompt_field=None,
                        shard_size=8, limit=None, target_layers=4,
                        target_layer_ids=dflash_layer_ids(36, 4))
    assert RunConfig.from_json(written.to_json()) == written
    for schema, shown in ((None, "none"), (RUN_SCHEMA + 1, str(RUN_SCHEMA + 1))):
        data = {**written.to_json(), "schema": schema}
        with pytest.raises(SchemaMismatch) as refused:
            RunConfig.from_json(data)
        assert str(refused.value) == (f"runs/r/run.json has schema {shown}; this release of "
                                      f"dflash-pipeline reads schema {RUN_SCHEMA} (read the run "
                                      "with the release that wrote it)")
    from dataclasses import replace

    assert written.differences(replace(written, target_layer_ids=[1, 2])) == [
        "target_layer_ids"]
