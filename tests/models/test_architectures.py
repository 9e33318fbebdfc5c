import pytest
from tiny import FAMILIES, tiny_config, tiny_model

from leanlm.errors import UnsupportedArchitectureError
from leanlm.models import TABLES, architecture_for, iter_quantizable_linears, supported_model_types
from leanlm.models.architectures import linear_weight_out_in, rotary_fraction


def test_every_family_has_a_tiny_model():
    assert set(FAMILIES) == set(supported_model_types())


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


def test_unknown_family_is_refused_by_name():
    class Config:
        model_type = "bloom"

    with pytest.raises(UnsupportedArchitectureError, match="bloom.*supported: .*llama"):
        architecture_for(Config())


def test_post_layernorm_opt_is_refused():
    config = tiny_config("opt")
    config.do_layer_norm_before = False
    with pytest.raises(UnsupportedArchitectureError, match="post-LayerNorm"):
        architecture_for(config)


def test_model_types_are_unique_across_tables():
    types = [t for table in TABLES for t in table.model_types]
    assert len(types) == len(set(types))
