import pytest
import torch
from safetensors.torch import load_file
from tiny import tiny_model

from leanlm.errors import ConfigError, CorruptModelError, DataError
from leanlm.methods import LoRAConfig, add_lora_
from leanlm.training import FinetuneSettings, finetune

LORA = LoRAConfig(base="nf4-dq", rank=4, dropout=0.1)
DOCUMENTS = [f"The {i}th sentence of a small training text, about item {i % 7}." for i in range(120)]


def _run(tmp_path, tokenizer, settings, resume=False, documents=DOCUMENTS, base="tiny"):
    torch.manual_seed(0)
    model = tiny_model("llama", vocab_size=len(tokenizer))
    add_lora_(model, LORA)
    record = finetune(model, tokenizer, documents, settings, LORA, tmp_path, base, resume=resume, progress=False)
    return model, record


def test_training_lowers_the_loss_and_writes_adapter_and_curve(tmp_path, smollm2_tokenizer):
    settings = FinetuneSettings(max_steps=30, batch_size=2, seq_len=32, lr=3e-3, save_every=10)
    _, record = _run(tmp_path, smollm2_tokenizer, settings)
    assert record["steps"] == 30 and len(record["losses"]) == 30
    assert sum(record["losses"][-5:]) < sum(record["losses"][:5])
    assert record["eval_perplexity"] > 1 and record["peak_memory_bytes"] > 0 and record["optimizer_state_bytes"] > 0
    for name in ("adapter_config.json", "adapter_model.safetensors", "loss_curve.png", "checkpoint/trainer_state.json"):
        assert (tmp_path / name).is_file(), name


def test_resume_continues_and_refuses_what_would_not_be_the_same_run(tmp_path, smollm2_tokenizer):
    settings = FinetuneSettings(max_steps=4, batch_size=2, seq_len=32, save_every=2)
    _run(tmp_path / "a", smollm2_tokenizer, settings)
    with pytest.raises(ConfigError, match="already holds a training checkpoint"):
        _run(tmp_path / "a", smollm2_tokenizer, settings)
    with pytest.raises(ConfigError, match="trained with other settings"):
        _run(tmp_path / "a", smollm2_tokenizer, FinetuneSettings(max_steps=6, batch_size=3, seq_len=32), resume=True)
    with pytest.raises(ConfigError, match="holds no training checkpoint"):
        _run(tmp_path / "b", smollm2_tokenizer, settings, resume=True)
    longer = FinetuneSettings(max_steps=6, batch_size=2, seq_len=32, save_every=2)
    with pytest.raises(ConfigError, match="trained on other data"):
        _run(tmp_path / "a", smollm2_tokenizer, longer, resume=True, documents=DOCUMENTS[::-1])
    with pytest.raises(ConfigError, match="trains 'tiny', not 'other'"):
        _run(tmp_path / "a", smollm2_tokenizer, longer, resume=True, base="other")
    _, record = _run(tmp_path / "a", smollm2_tokenizer, longer, resume=True)
    assert len(record["losses"]) == 6


@pytest.mark.parametrize("damaged", ["trainer_state.json", "adapters.safetensors", "optimizer.safetensors"])
def test_a_checkpoint_file_cut_in_half_is_named(tmp_path, smollm2_tokenizer, damaged):
    settings = FinetuneSettings(max_steps=2, batch_size=2, seq_len=32, save_every=2)
    _run(tmp_path, smollm2_tokenizer, settings)
    path = tmp_path / "checkpoint" / damaged
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CorruptModelError, match=damaged) as raised:
        _run(tmp_path, smollm2_tokenizer, FinetuneSettings(max_steps=4, batch_size=2, seq_len=32, save_every=2), True)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("seed", [-1, 2**63, 2**70])
def test_a_seed_beyond_what_generators_take_is_refused(seed):
    with pytest.raises(ConfigError, match="seed must be a whole number from 0 to 2\\*\\*63 - 1"):
        FinetuneSettings(seed=seed)


def test_too_little_text_is_named(tmp_path, smollm2_tokenizer):
    with pytest.raises(DataError, match="training and .* held-out blocks"):
        model = tiny_model("llama", vocab_size=len(smollm2_tokenizer))
        add_lora_(model, LORA)
        finetune(model, smollm2_tokenizer, DOCUMENTS[:3], FinetuneSettings(seq_len=512), LORA, tmp_path, "tiny")


def test_adapters_equal_after_interrupted_and_resumed_run_in_process(tmp_path, smollm2_tokenizer):
    """The in-process half of the resume check (the CLI test kills a real process)."""
    settings = FinetuneSettings(max_steps=6, batch_size=2, seq_len=32, save_every=3)
    _run(tmp_path / "whole", smollm2_tokenizer, settings)
    _run(tmp_path / "split", smollm2_tokenizer, FinetuneSettings(**{**settings.__dict__, "max_steps": 3}))
    _run(tmp_path / "split", smollm2_tokenizer, settings, resume=True)
    whole = load_file(str(tmp_path / "whole" / "adapter_model.safetensors"))
    split = load_file(str(tmp_path / "split" / "adapter_model.safetensors"))
    assert whole.keys() == split.keys()
    assert all(torch.equal(whole[k], split[k]) for k in whole)


def test_gradient_checkpointing_trains_the_same_adapters(tmp_path, smollm2_tokenizer):
    plain = FinetuneSettings(max_steps=3, batch_size=2, seq_len=32, save_every=3)
    checkpointed = FinetuneSettings(**{**plain.__dict__, "gradient_checkpointing": True})
    _, without = _run(tmp_path / "a", smollm2_tokenizer, plain)
    _, with_checkpointing = _run(tmp_path / "b", smollm2_tokenizer, checkpointed)
    assert with_checkpointing["losses"] == pytest.approx(without["losses"], rel=1e-5)
