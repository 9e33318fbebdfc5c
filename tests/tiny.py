"""Tiny random models of every supported family, built from a config in milliseconds."""

from __future__ import annotations

import torch
import transformers as hf

# Keys of `tiny_config`: model types, and "llama3" for a Llama with Llama 3's rope scaling.
FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "opt", "gpt2", "gpt_neox")


def tiny_config(model_type: str, vocab_size: int = 128, layers: int = 2, width: int = 64):
    """`width`: the hidden size of the Llama-like families (their MLP is twice as wide)."""
    common = dict(vocab_size=vocab_size, num_hidden_layers=layers, max_position_embeddings=256)
    llama_like = dict(
        common, hidden_size=width, intermediate_size=2 * width, num_attention_heads=4, num_key_value_heads=2
    )
    if model_type == "llama":
        return hf.LlamaConfig(**llama_like, tie_word_embeddings=True)
    if model_type == "llama3":
        rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
        return hf.LlamaConfig(**llama_like, rope_parameters=dict(rope, original_max_position_embeddings=64))
    if model_type == "qwen3":
        return hf.Qwen3Config(**llama_like, head_dim=16)
    if model_type == "phi3":
        return hf.Phi3Config(**llama_like, pad_token_id=0)
    if model_type == "gemma2":
        return hf.Gemma2Config(**llama_like, head_dim=16)
    if model_type == "mistral":
        return hf.MistralConfig(**llama_like)
    if model_type == "qwen2":
        return hf.Qwen2Config(**llama_like)
    if model_type == "gemma3_text":
        return hf.Gemma3TextConfig(**dict(llama_like, num_key_value_heads=1), head_dim=16)
    if model_type == "opt":
        return hf.OPTConfig(**common, hidden_size=64, ffn_dim=128, num_attention_heads=4, word_embed_proj_dim=64)
    if model_type == "gpt2":
        return hf.GPT2Config(
            vocab_size=vocab_size, n_embd=64, n_layer=layers, n_head=4, n_positions=256, bos_token_id=0, eos_token_id=0
        )
    if model_type == "gpt_neox":
        return hf.GPTNeoXConfig(**common, hidden_size=64, intermediate_size=128, num_attention_heads=4, rotary_pct=0.25)
    raise ValueError(model_type)


def tiny_model(model_type: str = "llama", vocab_size: int = 128, layers: int = 2, seed: int = 0, width: int = 64):
    torch.manual_seed(seed)
    config = tiny_config(model_type, vocab_size, layers, width)
    model = hf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def token_ids(*shape: int, seed: int = 0, vocab_size: int = 128) -> torch.Tensor:
    """Token ids of `shape` below `vocab_size` (a tiny model's), the same for the same seed whatever ran before."""
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def save_tiny_llama(directory, tokenizer):
    """A local HF model directory: a tiny random Llama with `tokenizer` (SmolLM2's, so real text works)."""
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def byte_tokenizer():
    """A byte-level BPE tokenizer of 258 tokens (the 256 bytes, one merge, an end token), built in code: a model
    with it converts to and from GGUF in a fraction of a second, where a real vocabulary takes seconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: index for index, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab |= {"Ġt": len(vocab), "<|endoftext|>": len(vocab) + 1}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "t")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def tiny_tokenizer(vocab_size: int = 128):
    """A word-level tokenizer of the tiny models' vocabulary ("t0" .. "t127")."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))
