"""ModelConfig: presets, validation, HF round trip, tensor table."""

import dataclasses

import pytest

from nanoqwen.config import PRESETS, ConfigError, ModelConfig, preset


def test_7b_preset_matches_the_architecture():
    c = preset("7b")
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (
        28,
        3584,
        18944,
        152064,
    )
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.group_ratio) == (28, 4, 128, 7)
    assert c.rope_theta == 1e6 and c.rms_norm_eps == 1e-6 and not c.tie_word_embeddings
    # 4.46 GB per decode step: INT4 weights + fp16 scales + fp16 lm_head (the figure).
    assert abs(c.weight_bytes_per_token() / 1e9 - 4.455) < 0.01


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip(name):
    c = PRESETS[name]
    assert ModelConfig.from_dict(c.to_dict()) == c
    assert ModelConfig.from_hf(c.to_hf(), name=c.name) == c
    shapes = c.tensor_shapes()
    assert ("lm_head" in shapes) != c.tie_word_embeddings
    assert len(shapes) == 1 + c.num_layers * (2 + 7 * 2 + 3) + 1 + (not c.tie_word_embeddings)


def test_projection_shapes_7b():
    shapes = preset("7b").tensor_shapes()
    assert shapes["layers.0.q_proj.qweight"] == ("uint32", (3584, 448))
    assert shapes["layers.0.k_proj.scales"] == ("float16", (512, 28))
    assert shapes["layers.27.down_proj.qweight"] == ("uint32", (3584, 18944 // 8))
    assert shapes["layers.5.v_proj.bias"] == ("float16", (512,))
    assert "layers.0.o_proj.bias" not in shapes


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_kv_heads": 3}, "not a multiple of num_kv_heads"),
        ({"head_dim": 100}, "!= hidden_size"),
        ({"intermediate_size": 1000}, "multiple of the INT4 group size"),
        ({"num_layers": 0}, "positive integer"),
        ({"vocab_size": True}, "positive integer"),
        ({"rms_norm_eps": 0.0}, "positive"),
    ],
)
def test_invalid_configs(change, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(preset("7b"), **change)


def test_from_dict_and_hf_errors():
    with pytest.raises(ConfigError, match="unknown model config fields: bogus"):
        ModelConfig.from_dict({**preset("tiny").to_dict(), "bogus": 1})
    with pytest.raises(ConfigError, match="incomplete"):
        ModelConfig.from_dict({"name": "x"})
    with pytest.raises(ConfigError, match="only 'qwen2'"):
        ModelConfig.from_hf({"model_type": "llama"})
    hf = preset("tiny").to_hf()
    del hf["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_hf(hf)
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("70b")
