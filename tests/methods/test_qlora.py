import copy

import pytest
import torch
from tiny import tiny_model
from torch import nn

from leanlm.errors import ConfigError
from leanlm.methods import LoRAConfig, add_lora_, load_adapters_, merge_lora_, save_adapters
from leanlm.methods.qlora import LORA_BASES, lora_layers, read_adapter_config
from leanlm.nn import KbitLinear


def _trained_looking(model):
    """Adapters with non-zero B, as after training."""
    generator = torch.Generator().manual_seed(3)
    for layer in lora_layers(model).values():
        with torch.no_grad():
            layer.lora_B.weight.copy_(0.05 * torch.randn(layer.lora_B.weight.shape, generator=generator))
    return model


def test_qlora_freezes_a_nf4_dq_base_and_wraps_every_block_linear():
    model = tiny_model("llama")
    record = add_lora_(model, LoRAConfig(base="nf4-dq", rank=4))
    layers = lora_layers(model)
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down per block
    assert all(isinstance(layer.base, KbitLinear) and layer.base.double_quant for layer in layers.values())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert record["trainable_parameters"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    ids = torch.randint(0, 128, (2, 16))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    # B starts at zero, so only B gets a gradient at step 0 (A's is B^T times something).
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    with pytest.raises(ConfigError, match="already has LoRA"):
        add_lora_(model, LoRAConfig())


@pytest.mark.parametrize("base", ["nf4-dq", "float"])
def test_peft_loads_leanlm_adapters_onto_the_dequantized_base(tmp_path, base):
    peft = pytest.importorskip("peft", reason="peft is in leanlm's test extras")
    original = tiny_model("llama")
    ours = _trained_looking(copy.deepcopy(original))
    add_lora_(ours, LoRAConfig(base=base, rank=4, alpha=8, dropout=0.0))
    _trained_looking(ours)
    save_adapters(ours, LoRAConfig(base=base, rank=4, alpha=8, dropout=0.0), tmp_path, "tiny")
    dequantized = copy.deepcopy(original)
    for name, layer in lora_layers(ours).items():
        weight = layer.base.dequantized_weight() if isinstance(layer.base, KbitLinear) else layer.base.weight
        dequantized.get_submodule(name).weight.data.copy_(weight)
    theirs = peft.PeftModel.from_pretrained(dequantized, str(tmp_path)).eval()
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(
            theirs(input_ids=ids).logits, ours.eval()(input_ids=ids).logits, rtol=1e-4, atol=1e-4
        )
    assert read_adapter_config(tmp_path) == LoRAConfig(base=base, rank=4, alpha=8, dropout=0.0)


def test_adapters_reload_and_merge_without_changing_outputs(tmp_path):
    config = LoRAConfig(base="nf4", rank=4, dropout=0.0)
    model = tiny_model("llama")
    add_lora_(model, config)
    _trained_looking(model)
    save_adapters(model, config, tmp_path, "tiny")
    reloaded = tiny_model("llama")
    add_lora_(reloaded, config)
    load_adapters_(reloaded, tmp_path)
    ids = torch.randint(0, 128, (1, 20))
    with torch.no_grad():
        before = model.eval()(input_ids=ids).logits
        torch.testing.assert_close(reloaded.eval()(input_ids=ids).logits, before, rtol=0, atol=0)
        record = merge_lora_(model)
        assert not lora_layers(model) and isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=1e-5, atol=1e-5)
        requantized = merge_lora_(reloaded, LORA_BASES["nf4-dq"])
        assert isinstance(reloaded.model.layers[0].mlp.down_proj, KbitLinear)
        assert 0 < requantized["requantization_relative_error"] < 0.2
        assert record["requantized"] is None


def test_bad_lora_settings_are_named():
    with pytest.raises(ConfigError, match="unknown LoRA base 'nf3'"):
        LoRAConfig(base="nf3")
    with pytest.raises(ConfigError, match="rank must be at least 1"):
        LoRAConfig(rank=0)


def test_an_adapter_directory_runs_over_its_model_as_trained(tiny_llama_dir, tmp_path, smollm2_tokenizer, capsys):
    """`--adapter` (eval, stream, chat, serve): the model with its base quantized as in training and the trained
    adapters beside it gives the trained model's logits; a damaged adapter is one line before the model loads."""
    from leanlm.cli.main import main
    from leanlm.errors import CorruptModelError
    from leanlm.methods import load_any
    from leanlm.training import FinetuneSettings, finetune

    lora = LoRAConfig(base="nf4-dq", rank=4, dropout=0.0)
    trained = load_any(tiny_llama_dir)
    add_lora_(trained.model, lora)
    text = [f"Sentence {i} of a short text about item {i % 5}." for i in range(60)]
    settings = FinetuneSettings(max_steps=4, batch_size=2, seq_len=32, lr=1e-2, save_every=4)
    finetune(
        trained.model,
        smollm2_tokenizer,
        text,
        settings,
        lora,
        tmp_path / "adapter",
        str(tiny_llama_dir),
        progress=False,
    )
    trained.model.eval()
    ids = torch.tensor([smollm2_tokenizer.encode("Sentence 3 of a short text")])
    served = load_any(tiny_llama_dir, dtype="bfloat16", adapter=tmp_path / "adapter")
    assert "LoRA adapters" in served.dtype and "float32" in served.dtype
    with torch.no_grad():
        torch.testing.assert_close(served.model(ids).logits, trained.model(ids).logits)
        assert not torch.allclose(served.model(ids).logits, load_any(tiny_llama_dir).model(ids).logits, atol=1e-3)
    with pytest.raises(CorruptModelError, match="adapter_config.json"):
        load_any(tiny_llama_dir, adapter=tmp_path)
    argv = ["eval", str(tiny_llama_dir), "--tasks", "wikitext2", "--max-tokens", "512", "--seq-len", "128"]
    assert main([*argv, "--adapter", str(tmp_path / "adapter")]) == 0
    assert main([*argv, "--adapter", str(tmp_path / "missing")]) == 2
    assert "adapter_config.json" in capsys.readouterr().err
