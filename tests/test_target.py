"""``common.engine.target.TargetShape``: one reader of a target's settings, flat or under
text_config."""

from __future__ import annotations

import pytest

from common.engine.target import TargetShape
from common.errors import ConfigError
from tests.conftest import TinyTarget

# Qwen3.6-27B's config.json, the fields that matter (its model card's figures).
QWEN36 = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64,
        "intermediate_size": 17408, "vocab_size": 248320, "max_position_embeddings": 262144,
        "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
        "dtype": "bfloat16", "mtp_num_hidden_layers": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]},
    },
}


def test_nested_text_config_is_read_and_layer_types_derived() -> None:
    shape = TargetShape.from_dict(QWEN36)
    assert (shape.hidden_size, shape.num_layers, shape.vocab_size) == (5120, 64, 248320)
    assert shape.context_length == 262144 and shape.dtype == "bfloat16"
    assert shape.is_hybrid and shape.has_mtp and not shape.tie_word_embeddings
    # No layer_types stated: every 4th layer is full attention, as transformers derives.
    assert shape.full_attention_layers == list(range(3, 64, 4))
    assert len(shape.linear_attention_layers) == 48
    assert (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim) == (24, 4, 256)
    assert shape.intermediate_size == 17408 and shape.rope_theta == 1e7
    assert shape.rope_type == "default"


def test_a_config_without_sizes_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="size field"):
        TargetShape.from_dict({"model_type": "qwen3_5", "text_config": {"hidden_size": 8}})


def test_file_and_loaded_model_agree(target_model: TinyTarget) -> None:
    from transformers import AutoModelForCausalLM

    on_disk = TargetShape.from_dir(target_model.path)
    loaded = TargetShape.of(AutoModelForCausalLM.from_pretrained(target_model.path))
    fields = ("hidden_size", "num_layers", "layer_types", "vocab_size", "context_length",
              "tie_word_embeddings", "rope_theta", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "rms_norm_eps")
    assert {f: getattr(on_disk, f) for f in fields} == {f: getattr(loaded, f) for f in fields}
    assert on_disk.is_hybrid == target_model.hybrid
    assert on_disk.has_mtp == target_model.hybrid


def test_an_mtp_head_is_read_from_the_field_its_family_states() -> None:
    # MiMo-7B's config.json (the fields that matter): Qwen2 layers, one MTP layer.
    mimo = {"architectures": ["MiMoForCausalLM"], "model_type": "mimo", "hidden_size": 4096,
            "num_hidden_layers": 36, "vocab_size": 151680, "num_nextn_predict_layers": 1}
    assert TargetShape.from_dict(mimo).has_mtp and not TargetShape.from_dict(mimo).is_hybrid
    assert not TargetShape.from_dict({**mimo, "num_nextn_predict_layers": 0}).has_mtp
    plain = {k: v for k, v in mimo.items() if k != "num_nextn_predict_layers"}
    assert not TargetShape.from_dict(plain).has_mtp
