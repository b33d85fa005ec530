"""Rope scaling read from config.json in both layouts (transformers 4.x `rope_scaling` +
`rope_theta`, 5.x `rope_parameters`), and the cos/sin tables it gives, against transformers'
own rope functions. Greedy parity of whole models: tests/engine/test_parity_hf.py."""
import pytest
import torch

from batchrun.engine.layers.rotary import RotaryEmbedding
from batchrun.engine.models.config import ModelConfig
from batchrun.errors import ModelLoadError

BASE = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 100,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}


def _cfg(**raw) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **raw})


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "beta_fast": 16,
     "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
     "attention_factor": 1.3, "truncate": False},
])
def test_both_layouts_give_transformers_tables(scaling):
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    old = _cfg(rope_theta=20000.0, rope_scaling=dict(scaling))
    new = _cfg(rope_parameters={**scaling, "rope_theta": 20000.0})
    assert (old.rope_theta, old.rope_scaling) == (new.rope_theta, new.rope_scaling)
    rope = RotaryEmbedding(old.head_dim, 3000, old.rope_theta, old.rope_scaling)
    rope.init_cache("cpu")
    hf = Qwen2Config(**{k: v for k, v in BASE.items() if k not in ("architectures", "model_type")},
                     rope_parameters={**scaling, "rope_theta": 20000.0})
    inv_freq, factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    freqs = torch.outer(torch.arange(3000).float(), inv_freq)
    want = torch.cat([freqs.cos() * factor, freqs.sin() * factor], dim=-1)
    torch.testing.assert_close(rope.cos_sin, want, rtol=0, atol=2e-5)


def test_yarn_defaults_follow_transformers():
    # no original length in rope_scaling: the top-level field (Phi-3 style), else the context;
    # no factor: the ratio of the two
    c = _cfg(rope_scaling={"rope_type": "yarn"}, original_max_position_embeddings=1024)
    assert c.rope_scaling["original_max_position_embeddings"] == 1024
    assert c.rope_scaling["factor"] == 4.0
    c = _cfg(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    assert c.rope_scaling["original_max_position_embeddings"] == 4096


@pytest.mark.parametrize("layout", ["4.x", "5.x"])
@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_short_and_long_tables_are_transformers(layout, partial):
    # Phi-3 style: the pretraining length top-level, factor from the two lengths
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    half = int(16 * partial) // 2
    scaling = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
               "long_factor": [1.0 + 0.7 * i for i in range(half)]}
    raw = {**BASE, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
           "original_max_position_embeddings": 512}
    if layout == "4.x":
        c = ModelConfig.from_dict({**raw, "rope_scaling": scaling, "partial_rotary_factor": partial})
    else:
        c = ModelConfig.from_dict({**raw, "rope_parameters": {**scaling, "rope_theta": 10000.0,
                                                              "partial_rotary_factor": partial}})
    assert c.rotary_dim == 2 * half and c.rope_scaling["factor"] == 8.0
    rope = RotaryEmbedding(c.rotary_dim, 4096, c.rope_theta, c.rope_scaling)
    rope.init_cache("cpu")
    hf = Phi3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")},
                    rope_parameters={**scaling, "rope_theta": 10000.0, "partial_rotary_factor": partial})
    t = torch.arange(4096).float()
    for rows, seq_len in ((slice(0, 4096), None), (slice(4096, 8192), 513)):
        inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=seq_len)
        freqs = torch.outer(t, inv_freq)
        want = torch.cat([freqs.cos() * factor, freqs.sin() * factor], dim=-1)
        torch.testing.assert_close(rope.cos_sin[rows], want, rtol=0, atol=2e-5)
    assert (rope.long_from, rope.long_offset) == (512, 4096)  # where the long rows start


def test_dynamic_is_the_default_table_within_the_context():
    # transformers rescales dynamic rope only past max_position_embeddings, which
    # engine.max_model_len never allows
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    c = _cfg(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert c.rope_scaling is None
    hf = Qwen2Config(**{k: v for k, v in BASE.items() if k not in ("architectures", "model_type")},
                     rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    default = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    for seq_len in (None, 100, 4096):
        inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=seq_len)
        torch.testing.assert_close(inv_freq, default, rtol=0, atol=0)


@pytest.mark.parametrize("scaling, match", [
    ({"rope_type": "su", "factor": 2.0}, "'su' is not supported .*linear, dynamic, yarn, longrope"),
    ({"rope_type": "dynamic"}, "dynamic needs a positive 'factor'"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8}, "longrope needs 'long_factor', a list of 8"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8},
     "longrope needs 'short_factor', a list of 8"),
    ({"rope_type": "linear"}, "linear needs a positive 'factor'"),
    ({"rope_type": "linear", "factor": -1}, "linear needs a positive 'factor'"),
])
def test_unsupported_or_incomplete_scaling_is_refused(scaling, match):
    with pytest.raises(ModelLoadError, match=match):
        _cfg(rope_scaling=scaling)


@pytest.mark.parametrize("family", sorted(__import__("tests.helpers.models", fromlist=["FAMILIES"]).FAMILIES))
def test_a_field_config_json_leaves_out_takes_the_transformers_class_default(family):
    # A config.json with only the sizes reads as the same model as the full one transformers'
    # config class writes for those sizes: activation, rope thetas, windows, head_dim, soft-caps,
    # eps, expert counts, special tokens. (A Gemma config without hidden_activation ran SiLU.)
    import dataclasses

    import transformers
    from tests.helpers.models import FAMILIES
    conf_cls, model_cls = FAMILIES[family]
    sizes = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4)
    if family in ("qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe"):
        sizes["num_key_value_heads"] = 2  # their class default (8 to 32) exceeds 4 heads
    full = getattr(transformers, conf_cls)(**sizes).to_dict()
    ours = ModelConfig.from_dict(dict(sizes, architectures=[model_cls]))
    theirs = ModelConfig.from_dict(dict(full, architectures=[model_cls]))
    differ = {f.name: (getattr(ours, f.name), getattr(theirs, f.name))
              for f in dataclasses.fields(ModelConfig) if getattr(ours, f.name) != getattr(theirs, f.name)}
    assert differ == {}
