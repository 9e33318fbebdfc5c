import pytest
import torch
from tiny import tiny_model

from leanlm.formats.blockwise import bits_per_parameter
from leanlm.methods import KbitConfig, load_quantized, quantize_, save_quantized
from leanlm.methods.kbit import proxy_columns
from leanlm.models.architectures import proxy_source_weights
from leanlm.nn import KbitLinear


def test_proxy_columns_are_the_previous_units_with_the_widest_weights():
    source = torch.randn(50, 20) * 0.1
    source[[7, 31]] *= 30
    assert sorted(proxy_columns(source, 0.04).tolist()) == [7, 31]
    assert proxy_columns(source, 0.001) is None  # rounds to no column


def test_proxy_sources_follow_the_residual_stream_and_the_value_path():
    model = tiny_model("llama")  # 4 query heads over 2 key/value heads
    sources = proxy_source_weights(model)
    layers = model.model.layers
    assert torch.equal(sources["model.layers.0.self_attn.q_proj"], model.model.embed_tokens.weight.t())
    assert torch.equal(sources["model.layers.1.self_attn.k_proj"], layers[0].mlp.down_proj.weight)
    assert torch.equal(sources["model.layers.0.mlp.up_proj"], layers[0].self_attn.o_proj.weight)
    assert torch.equal(sources["model.layers.0.mlp.down_proj"], layers[0].mlp.up_proj.weight)
    # GQA: o_proj input dim d reads value head (d // head_dim) // groups.
    o_source, v = sources["model.layers.0.self_attn.o_proj"], layers[0].self_attn.v_proj.weight
    assert o_source.shape == (64, 64) and torch.equal(o_source[16:32], v[:16]) and torch.equal(o_source[32:48], v[16:])


def test_proxy_quantization_keeps_those_columns_in_fp16_and_counts_them(tmp_path):
    model = tiny_model("llama")
    config = KbitConfig(dtype="int", bits=3, block_size=32, proxy_fraction=0.05)
    record = quantize_(model, config)
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, KbitLinear) and down.proxy_columns.numel() == round(0.05 * 128)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.proxy_columns.numel() == round(0.05 * 64)
    # Exact account: codes + constants + 16 bits per kept weight + the column indices.
    expected = bits_per_parameter(3, 32, False, 0.05)
    assert record["avg_bits"] == pytest.approx(expected, abs=0.06) and record["avg_bits"] > bits_per_parameter(
        3, 32, False
    )


def test_proxy_columns_survive_a_checkpoint_and_shape_the_output(tiny_llama_dir, tmp_path):
    from leanlm.models import load_model

    loaded = load_model(str(tiny_llama_dir))
    record = quantize_(loaded.model, KbitConfig(bits=4, block_size=64, proxy_fraction=0.1))
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        before = loaded.model(input_ids=ids).logits
    save_quantized(loaded, loaded.model, record, tmp_path / "q")
    reloaded, _ = load_quantized(tmp_path / "q")
    with torch.inference_mode():
        torch.testing.assert_close(reloaded.model(input_ids=ids).logits, before)
    module = loaded.model.model.layers[0].self_attn.q_proj
    weight = module.dequantized_weight()
    assert torch.equal(weight[:, module.proxy_columns.long()], module.proxy_weight.float())


def test_an_int8_head_holds_a_tied_table_once_and_keeps_the_logits():
    """`--head int8` (quantize_head_): the head becomes 8-bit int blocks of 64 and a tied embedding reads its rows
    from the head's codes (one 8-bit table, as llama.cpp's Q8_0 token_embd); the config no longer ties them.
    Logits stay within 1% (SQNR > 40 dB) at decode and at prefill sizes; an untied embedding stays float."""
    from leanlm.methods.checkpoint import quantize_head_
    from leanlm.nn.kbit_linear import KbitEmbedding

    model = tiny_model("llama", vocab_size=256)
    ids = torch.tensor([[5, 9, 200, 31, 77]])
    with torch.no_grad():
        before = model(ids).logits
        quantize_head_(model)
        after = model(ids).logits
        last = model(ids[:, :1]).logits
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    assert isinstance(head, KbitLinear) and (head.bits, head.dtype, head.block_size) == (8, "int", 64)
    assert isinstance(embedding, KbitEmbedding) and embedding.head is head and not model.config.tie_word_embeddings
    assert torch.equal(embedding(ids)[0], head.dequantized_weight()[ids[0]])
    assert "embed_tokens" not in " ".join(name for name, _ in model.state_dict().items() if "packed" in name)
    for quantized, reference in ((after, before), (last, before[:, :1])):
        assert 20 * torch.log10(reference.norm() / (quantized - reference).norm()) > 40
    untied = tiny_model("mistral", vocab_size=256)
    table = untied.get_input_embeddings().weight.detach().clone()
    quantize_head_(untied)
    assert torch.equal(untied.get_input_embeddings().weight, table)
