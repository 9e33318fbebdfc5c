import pytest
from tiny import FAMILIES, tiny_config, tiny_model

from leanlm.errors import UnsupportedArchitectureError
from leanlm.models import FAMILY_FACTS, architecture_for, iter_quantizable_linears
from leanlm.models.architectures import LinearFeeds, NormFeeds, linear_weight_out_in, rotary_fraction


def test_every_family_with_hand_written_facts_has_a_tiny_model():
    assert {tiny_config(family).model_type for family in FAMILIES} >= set(FAMILY_FACTS)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_path_in_the_table_resolves(model_type):
    model = tiny_model(model_type)
    table = architecture_for(model)
    for path in (
        *table.never_quantize,
        table.final_norm,
        *([table.rotary_embedding] if table.rotary_embedding else []),
    ):
        model.get_submodule(path)
    linears = list(iter_quantizable_linears(model, table))
    assert len(linears) == 2 * len(table.quantizable_linears)
    for _, module in linears:
        assert module.weight.ndim == 2


@pytest.mark.parametrize("model_type", FAMILIES)
def test_norms_feed_linears_of_their_width(model_type):
    model = tiny_model(model_type)
    table = architecture_for(model)
    for block in model.get_submodule(table.blocks):
        for feed in table.norm_feeds:
            norm = block.get_submodule(feed.norm)
            assert "norm" in type(norm).__name__.lower()
            for path in feed.linears:
                weight = linear_weight_out_in(block.get_submodule(path), table)
                assert weight.shape[1] == norm.weight.shape[0]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_linear_feeds_connect_matching_widths(model_type):
    model = tiny_model(model_type)
    table = architecture_for(model)
    block = model.get_submodule(table.blocks)[0]
    for feed in table.linear_feeds:
        produced = linear_weight_out_in(block.get_submodule(feed.producer), table).shape[0]
        consumed = linear_weight_out_in(block.get_submodule(feed.consumer), table).shape[1]
        # v -> o under grouped-query attention: each key/value head serves several query heads.
        assert consumed % produced == 0


def test_attention_and_mlp_roles_of_the_llama_table():
    table = architecture_for(tiny_config("llama"))
    assert table.attention_inputs == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    assert table.mlp_output == "mlp.down_proj" and table.positions == "rope"
    assert "lm_head" in table.never_quantize


def test_gpt2_conv1d_weights_are_read_as_out_in():
    model = tiny_model("gpt2")
    table = architecture_for(model)
    fc = model.get_submodule(f"{table.blocks}.0.{table.mlp_inputs[0]}")
    assert type(fc).__name__ == "Conv1D"
    assert linear_weight_out_in(fc, table).shape == (256, 64)


def test_positions_and_partial_rotary():
    assert architecture_for(tiny_config("opt")).positions == "learned"
    assert rotary_fraction(tiny_config("gpt_neox")) == pytest.approx(0.25)
    assert rotary_fraction(tiny_config("llama")) == 1.0


def test_something_that_is_not_a_config_is_refused_by_name():
    class Config:
        model_type = "bloom"

    with pytest.raises(UnsupportedArchitectureError, match="Config is not a transformers model config"):
        architecture_for(Config())


def test_post_layernorm_opt_is_refused():
    config = tiny_config("opt")
    config.do_layer_norm_before = False
    with pytest.raises(UnsupportedArchitectureError, match="post-LayerNorm"):
        architecture_for(config)


# The rows once written by hand, which the derivation must reproduce, and rows for families added since.
EXPECTED = {
    "llama": dict(
        blocks="model.layers",
        attention_inputs=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        attention_output="self_attn.o_proj",
        mlp_inputs=("mlp.gate_proj", "mlp.up_proj"),
        mlp_output="mlp.down_proj",
        mlp_activation="swiglu",
        norm_feeds=(
            NormFeeds("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            NormFeeds("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ),
        linear_feeds=(
            LinearFeeds("self_attn.v_proj", "self_attn.o_proj"),
            LinearFeeds("mlp.up_proj", "mlp.down_proj"),
        ),
        positions="rope",
        rotary_embedding="model.rotary_emb",
        final_norm="model.norm",
        never_quantize=("model.embed_tokens", "lm_head"),
        norm_kind="rms",
        norm_weight_offset=0.0,
        output_norms=None,
        qk_norms=None,
    ),
    "gemma3_text": dict(
        mlp_activation="geglu",
        norm_feeds=(
            NormFeeds("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            NormFeeds("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ),
        norm_weight_offset=1.0,
        output_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
        qk_norms=("self_attn.q_norm", "self_attn.k_norm"),
    ),
    "gemma2": dict(
        norm_feeds=(
            NormFeeds("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            NormFeeds("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ),
        mlp_activation="geglu",
        norm_weight_offset=1.0,
        output_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
    ),
    "qwen3": dict(qk_norms=("self_attn.q_norm", "self_attn.k_norm"), norm_weight_offset=0.0),
    "phi3": dict(
        attention_inputs=("self_attn.qkv_proj",),
        mlp_inputs=("mlp.gate_up_proj",),
        norm_feeds=(
            NormFeeds("input_layernorm", ("self_attn.qkv_proj",)),
            NormFeeds("post_attention_layernorm", ("mlp.gate_up_proj",)),
        ),
        linear_feeds=(),
        fused_qkv=True,
        fused_gate_up=True,
        mlp_activation="swiglu",
    ),
    "opt": dict(
        blocks="model.decoder.layers",
        attention_output="self_attn.out_proj",
        mlp_inputs=("fc1",),
        mlp_output="fc2",
        mlp_activation="relu",
        norm_feeds=(
            NormFeeds("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            NormFeeds("final_layer_norm", ("fc1",)),
        ),
        linear_feeds=(LinearFeeds("self_attn.v_proj", "self_attn.out_proj"), LinearFeeds("fc1", "fc2")),
        positions="learned",
        final_norm="model.decoder.final_layer_norm",
        never_quantize=("model.decoder.embed_tokens", "model.decoder.embed_positions", "lm_head"),
        norm_kind="layer",
    ),
    "gpt2": dict(
        blocks="transformer.h",
        attention_inputs=("attn.c_attn",),
        attention_output="attn.c_proj",
        mlp_inputs=("mlp.c_fc",),
        mlp_output="mlp.c_proj",
        mlp_activation="gelu",
        norm_feeds=(NormFeeds("ln_1", ("attn.c_attn",)), NormFeeds("ln_2", ("mlp.c_fc",))),
        linear_feeds=(),
        positions="learned",
        final_norm="transformer.ln_f",
        never_quantize=("transformer.wte", "transformer.wpe", "lm_head"),
        fused_qkv=True,
        weight_layout="in_out",
    ),
    "gpt_neox": dict(
        blocks="gpt_neox.layers",
        attention_inputs=("attention.query_key_value",),
        attention_output="attention.dense",
        mlp_inputs=("mlp.dense_h_to_4h",),
        mlp_output="mlp.dense_4h_to_h",
        mlp_activation="gelu",
        norm_feeds=(
            NormFeeds("input_layernorm", ("attention.query_key_value",)),
            NormFeeds("post_attention_layernorm", ("mlp.dense_h_to_4h",)),
        ),
        linear_feeds=(),
        positions="rope",
        final_norm="gpt_neox.final_layer_norm",
        never_quantize=("gpt_neox.embed_in", "lm_head"),
        rotary_embedding="gpt_neox.rotary_emb",
        fused_qkv=True,
    ),
}
EXPECTED["llama3"] = EXPECTED["mistral"] = EXPECTED["qwen2"] = EXPECTED["llama"]


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_the_derived_table_is_the_family_s_layout(family):
    table = architecture_for(tiny_config(family))
    expected = (
        {**EXPECTED["llama"], **EXPECTED[family]}
        if family in ("gemma2", "gemma3_text", "qwen3", "phi3")
        else EXPECTED[family]
    )
    assert {name: getattr(table, name) for name in expected} == expected


def test_derivation_runs_once_per_config_without_weights():
    config = tiny_config("qwen3")
    assert architecture_for(config) is architecture_for(config)
    assert architecture_for(config) == architecture_for(tiny_model("qwen3"))
    import transformers as hf

    eight_b = hf.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8
    )
    assert architecture_for(eight_b).mlp_inputs == ("mlp.gate_proj", "mlp.up_proj")  # on meta tensors: no 32 GB


def test_a_parallel_block_has_one_norm_feeding_attention_and_mlp():
    import transformers as hf

    config = hf.PhiConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    table = architecture_for(config)
    assert table.norm_feeds == (
        NormFeeds("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.fc1")),
    )
    assert table.norm_kind == "layer" and table.mlp_activation == "gelu"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda hf: hf.MixtralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4), "mixture-of-experts"),
        (lambda hf: hf.T5Config(), "'t5': transformers cannot build it as a causal language model: Unrecognized"),
        (lambda hf: hf.PretrainedConfig(model_type="mystery"), "'mystery'"),
    ],
)
def test_a_layout_leanlm_cannot_derive_is_one_line(make, message):
    import transformers as hf

    with pytest.raises(UnsupportedArchitectureError, match=message) as error:
        architecture_for(make(hf))
    assert "\n" not in str(error.value)


def test_a_config_is_serialized_once_until_it_changes(monkeypatch):
    """The table of a config is found again without serializing the config (a server asks for it per request); a
    config changed since, even inside a nested value, is read again."""
    config = tiny_config("llama")
    config.extra_settings = {"depth": 1}
    table = architecture_for(config)
    serialized = []
    original = type(config).to_json_string

    def counting(self, *args, **kwargs):
        serialized.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(config), "to_json_string", counting)
    assert architecture_for(config) is table and not serialized
    config.extra_settings["depth"] = 2
    assert architecture_for(config) == table and len(serialized) == 1
    assert architecture_for(config) == table and len(serialized) == 1


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text"])
def test_the_attention_shape_is_what_the_family_s_attention_computes_with(model_type):
    """attention_shape gives the widths of a tiny model's query and key projections in every family with GQA or
    its own head size; a config without key-value heads or head size has as many as query heads and hidden /
    heads, as transformers reads it."""
    from types import SimpleNamespace

    from leanlm.models.architectures import attention_shape

    model = tiny_model(model_type)
    shape = attention_shape(model.config)
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.out_features == shape.heads * shape.head_dim
    assert attention.k_proj.out_features == shape.kv_heads * shape.head_dim
    bare = attention_shape(SimpleNamespace(num_attention_heads=4, hidden_size=64))
    assert (bare.heads, bare.kv_heads, bare.head_dim) == (4, 4, 16)
