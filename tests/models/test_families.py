"""Every family whose table leanlm derives, through every method it supports and a checkpoint round trip; methods
that need a fact a family lacks say which, in one line, before any work."""

import pytest
import torch
import transformers as hf
from tiny import FAMILIES, tiny_config, token_ids

from leanlm.errors import UnsupportedArchitectureError
from leanlm.methods import (
    Calibration,
    CushionConfig,
    GPTQConfig,
    KbitConfig,
    LLMInt8Config,
    RTNConfig,
    SmoothQuantConfig,
    SpQRConfig,
    W8A8Config,
    load_quantized,
    quantize_,
    save_quantized,
)
from leanlm.methods.streaming import StreamingConfig, sink_cache
from leanlm.models import architecture_for, load_model
from leanlm.nn import KbitLinear, SpQRLinear, W8A8Linear

QUANTIZED = (KbitLinear, SpQRLinear, W8A8Linear)

METHODS = {
    "nf4-dq": KbitConfig(double_quant=True),
    "rtn": RTNConfig(group_size=32),
    "gptq": GPTQConfig(group_size=32),
    "spqr": SpQRConfig(beta1=16),
    "llm-int8": LLMInt8Config(threshold=1.5),
    "cushion": [
        CushionConfig(candidates=12, max_length=2, min_improvement=0.0, sample_tokens=16, search_samples=1),
        W8A8Config(level="O3"),
    ],
}
# Relative logit error allowed on random tiny weights: loose bounds that a broken layer mapping far exceeds. A
# cushion is context the model reads first, so its logits are not the bare model's.
BOUND = {"nf4-dq": 0.5, "rtn": 0.5, "gptq": 0.5, "spqr": 0.5, "llm-int8": 0.1, "cushion": float("inf")}


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory, smollm2_tokenizer):
    """A saved tiny model of each family with SmolLM2's tokenizer (made once, on first use): with SmolLM2's
    vocabulary when it is to read text (a cushion's search), else with 128 tokens (calibrated on token ids)."""
    made = {}

    def make(family, reads_text):
        if (family, reads_text) not in made:
            directory = tmp_path_factory.mktemp(family)
            torch.manual_seed(0)
            config = tiny_config(family, vocab_size=len(smollm2_tokenizer) if reads_text else 128)
            hf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
            smollm2_tokenizer.save_pretrained(directory)
            made[family, reads_text] = directory
        return made[family, reads_text]

    return make


# Each module kind's checkpoint round trip on every family: k-bit, SpQR's (GPTQ, RTN and SpQR share it), W8A8's.
ROUND_TRIPS = ("nf4-dq", "spqr", "llm-int8", "cushion")
# A cushion's search costs seconds a family: fused q/k/v and gate/up, and OPT's flattened MLP inputs, stand for the
# rest (tests/methods/test_cushion.py runs it on Llama).
CASES = [(family, method) for family in FAMILIES for method in sorted(METHODS) if method != "cushion"]
CASES += [(family, "cushion") for family in ("phi3", "opt")]


@pytest.mark.parametrize("family, method", CASES)
def test_every_method_quantizes_every_family_and_each_module_kind_round_trips(family, method, float_dirs, tmp_path):
    reads_text = method == "cushion"
    loaded = load_model(float_dirs(family, reads_text))
    ids = token_ids(1, 16, seed=2)
    with torch.inference_mode():
        reference = loaded.model(ids).logits
    calibration = (
        Calibration(loaded.tokenizer, samples=4, seq_len=24) if reads_text else Calibration(token_ids=token_ids(4, 24))
    )
    record = quantize_(loaded.model, METHODS[method], calibration=calibration)
    replaced = [m for m in loaded.model.modules() if isinstance(m, QUANTIZED)]
    assert len(replaced) == 2 * len(loaded.table.quantizable_linears)
    with torch.inference_mode():
        quantized = loaded.model(ids).logits
    assert quantized.isfinite().all()
    assert ((quantized - reference).norm() / reference.norm()).item() < BOUND[method]
    if method not in ROUND_TRIPS:
        return
    reloaded, saved = load_quantized(save_quantized(loaded, loaded.model, record, tmp_path / "q"))
    assert saved["method"] == record["method"]
    with torch.inference_mode():
        torch.testing.assert_close(reloaded.model(ids).logits, quantized, rtol=0, atol=1e-5)


def _olmo2():
    return hf.Olmo2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )


def test_smoothquant_names_the_norm_a_post_norm_family_lacks_before_any_work():
    model = hf.AutoModelForCausalLM.from_config(_olmo2()).eval()
    with pytest.raises(UnsupportedArchitectureError, match="no norm's output is the input of self_attn.q_proj") as e:
        quantize_(model, [SmoothQuantConfig(), W8A8Config()], calibration=Calibration(token_ids=token_ids(2, 8)))
    assert "\n" not in str(e.value)
    assert not any(isinstance(m, QUANTIZED) for m in model.modules())
    quantize_(model, KbitConfig())  # weight-only methods need only the linears
    assert sum(isinstance(m, QUANTIZED) for m in model.modules()) == 14


def test_the_sink_cache_cushion_and_fused_step_name_what_a_family_lacks():
    from leanlm.decoding.fused import fused_decoder_problem

    gemma2 = hf.AutoModelForCausalLM.from_config(tiny_config("gemma2")).eval()
    assert "the fused decode step is checked against llama" in fused_decoder_problem(gemma2)
    with pytest.raises(UnsupportedArchitectureError, match="sliding-window"):
        sink_cache(gemma2, StreamingConfig(sinks=4, window=8))
    with pytest.raises(UnsupportedArchitectureError, match="mixes sliding-window and full-attention layers"):
        quantize_(gemma2, METHODS["cushion"])  # refused before it asks for calibration text
    table = architecture_for(hf.BloomConfig(n_layer=2, hidden_size=64, n_head=4, vocab_size=128))
    assert table.positions == "none" and table.rotary_embedding is None
