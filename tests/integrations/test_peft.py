"""PEFT's `get_peft_model` trains LoRA adapters over a leanlm NF4 + DQ checkpoint loaded by transformers, as peft
users write QLoRA, with the losses `leanlm finetune` gets for the same seed, data and settings (on a random model
here; the same holds on SmolLM2, where it takes much longer)."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny import save_tiny_llama
from transformers import AutoModelForCausalLM

import leanlm.methods as m
from leanlm.errors import ConfigError
from leanlm.integrations.peft import KbitLoraLinear
from leanlm.methods import LoRAConfig, add_lora_, load_any
from leanlm.training import FinetuneSettings, finetune
from leanlm.training.data import batch_indices, training_blocks

DOCUMENTS = [f"The {i}th sentence of a small training text, about item {i % 7}." for i in range(120)]
SETTINGS = FinetuneSettings(
    max_steps=8,
    batch_size=2,
    seq_len=32,
    lr=3e-3,
    save_every=100,
    optimizer_bits=32,
    gradient_checkpointing=False,
    max_eval_blocks=1,
)
LORA = LoRAConfig(base="nf4-dq", rank=4, alpha=8.0, dropout=0.0)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_tokenizer):
    """An NF4 + DQ checkpoint of a random model with SmolLM2's tokenizer."""
    loaded = load_any(save_tiny_llama(tmp_path_factory.mktemp("tiny"), smollm2_tokenizer))
    record = m.quantize_(loaded.model, m.KbitConfig())
    return m.save_quantized(loaded, loaded.model, record, tmp_path_factory.mktemp("q") / "nf4")


def _peft_losses(checkpoint, tokenizer) -> list[float]:
    """QLoRA as a peft user writes it: from_pretrained, get_peft_model, torch's AdamW, the model's own loss."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    torch.manual_seed(SETTINGS.seed)
    config = LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, lora_dropout=LORA.dropout, target_modules=TARGETS)
    model = get_peft_model(model, config)
    assert isinstance(model.base_model.model.model.layers[0].mlp.down_proj, KbitLoraLinear)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=SETTINGS.lr, weight_decay=0.0)
    blocks, _ = training_blocks(tokenizer, DOCUMENTS, SETTINGS.seq_len, SETTINGS.held_out_fraction, SETTINGS.seed, 64)
    warmup = max(1, round(SETTINGS.warmup_fraction * SETTINGS.max_steps))
    model.train()
    losses = []
    for step in range(SETTINGS.max_steps):
        for group in optimizer.param_groups:
            group["lr"] = SETTINGS.lr * min(1.0, (step + 1) / warmup)
        batch = blocks[batch_indices(step, SETTINGS.batch_size, len(blocks), SETTINGS.seed)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, SETTINGS.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_peft_qlora_over_a_leanlm_checkpoint_trains_as_leanlm_finetune_does(checkpoint, smollm2_tokenizer, tmp_path):
    loaded = load_any(checkpoint)
    torch.manual_seed(SETTINGS.seed)
    add_lora_(loaded.model, LORA)
    ours = finetune(loaded.model, smollm2_tokenizer, DOCUMENTS, SETTINGS, LORA, tmp_path, "tiny", progress=False)
    theirs = _peft_losses(checkpoint, smollm2_tokenizer)
    assert theirs[-1] < theirs[0] - 0.1  # it trains
    torch.testing.assert_close(torch.tensor(theirs), torch.tensor(ours["losses"]), rtol=1e-3, atol=1e-3)


def test_other_leanlm_layers_are_refused_by_name(tmp_path, smollm2_tokenizer):
    loaded = load_any(save_tiny_llama(tmp_path / "float", smollm2_tokenizer))
    record = m.quantize_(loaded.model, m.W8A8Config("O2"))
    quantized = AutoModelForCausalLM.from_pretrained(m.save_quantized(loaded, loaded.model, record, tmp_path / "w8a8"))
    with pytest.raises(ConfigError, match="peft LoRA over leanlm's W8A8Linear is not supported"):
        get_peft_model(quantized, LoraConfig(r=4, target_modules=["down_proj"]))
