import copy

import pytest
import torch
from tiny import tiny_model

from leanlm.nn import BmmQuantizer, use_int8_bmm_attention


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "phi3", "gemma2", "gemma3_text", "opt", "gpt2", "gpt_neox"])
def test_without_a_quantizer_it_is_exact_attention(model_type):
    model = tiny_model(model_type)
    ids = torch.randint(0, 128, (2, 17))
    with torch.inference_mode():
        expected = model(ids).logits
        use_int8_bmm_attention(model)
        assert torch.allclose(model(ids).logits, expected, atol=1e-5)


def test_gemma2_s_soft_capping_is_applied():
    from tiny import tiny_config
    from transformers import AutoModelForCausalLM

    config = tiny_config("gemma2")
    config.attn_logit_softcapping = 1.0
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(50)  # scores far beyond the cap
    ids = torch.randint(0, 128, (2, 17))
    with torch.inference_mode():
        expected = model(ids).logits
        use_int8_bmm_attention(model)
        assert torch.allclose(model(ids).logits, expected, atol=1e-5)
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        assert not torch.allclose(model(ids).logits, expected, atol=1e-3)


def _attentions(model):
    return [layer.self_attn for layer in model.model.layers]


def test_observing_records_ranges_without_changing_outputs():
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (1, 12))
    with torch.inference_mode():
        expected = model(ids).logits
        use_int8_bmm_attention(model)
        for attention in _attentions(model):
            attention.bmm_quantizer = BmmQuantizer()
            attention.bmm_quantizer.observe = True
        assert torch.allclose(model(ids).logits, expected, atol=1e-5)
    quantizer = _attentions(model)[0].bmm_quantizer
    assert quantizer.q_absmax > 0 and quantizer.k_absmax > 0
    assert quantizer.v_channel_absmax.shape == (2 * 16,)  # 2 kv heads x head_dim 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "activation, static, probs", [("per_token", False, False), ("per_tensor", False, True), ("per_tensor", True, False)]
)
def test_quantized_matmuls_stay_close(activation, static, probs, dtype):
    model = tiny_model("llama").to(dtype)
    ids = torch.randint(0, 128, (1, 24))
    with torch.inference_mode():
        expected = model(ids).logits
        observed = copy.deepcopy(model)
        use_int8_bmm_attention(observed)
        for attention in _attentions(observed):
            attention.bmm_quantizer = BmmQuantizer()
            attention.bmm_quantizer.observe = True
        observed(ids)
        for attention in _attentions(observed):
            ranges = attention.bmm_quantizer.state_dict()
            attention.bmm_quantizer = BmmQuantizer(activation, static, 32, quantize_probs=probs)
            attention.bmm_quantizer.load_state_dict(ranges)
        out = observed(ids).logits
    assert out.dtype == dtype and not torch.equal(out, expected)
    assert ((out - expected).float().norm() / expected.float().norm()) < 0.02


def test_probabilities_are_rounded_to_the_int8_grid_only_when_asked():
    from leanlm.nn.attention import int8_bmm_attention

    class Attention(torch.nn.Module):
        pass

    module = Attention()
    query, key, value = torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4), torch.eye(5, 4)[None, None]
    module.bmm_quantizer = BmmQuantizer(quantize_probs=True)
    _, probs = int8_bmm_attention(module, query, key, value, None)
    assert torch.allclose(probs * 127, (probs * 127).round(), atol=1e-4)
    module.bmm_quantizer = quantizer = BmmQuantizer(quantize_probs=False)
    out, probs = int8_bmm_attention(module, query, key, value, None)
    assert probs is None  # the fused path: nothing is done between the two matmuls
    q, k, v = (quantizer.quantize(t, which) for t, which in ((query, "q"), (key, "k"), (value, "v")))
    expected = torch.softmax(q @ k.transpose(2, 3) / 2, dim=-1) @ v
    assert torch.allclose(out, expected.transpose(1, 2), atol=1e-6)
