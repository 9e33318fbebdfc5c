"""llama.cpp's recipes: the type of each tensor of the files llama-quantize wrote for the three real models (the
counts the GGUF benchmark recorded from those files) is the type `recipe_types` gives, and so are the bits per
weight of their block linears."""

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import transformers as hf

from leanlm.errors import ConfigError
from leanlm.formats.gguf_blocks import BLOCK_TYPES
from leanlm.formats.llama_cpp_recipes import recipe_types
from leanlm.methods.bit_allocation import recipe_budget, recipe_rows

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results"
# The three real models' shapes (their weights are not needed: the model is built empty): config class, hidden,
# MLP, layers, heads, key-value heads, head dimension (None: hidden / heads), vocabulary, tied head
SHAPES = {
    "smollm2-135m": (hf.LlamaConfig, 576, 1536, 30, 9, 3, None, 49152, True),
    "gemma3-270m": (hf.Gemma3TextConfig, 640, 2048, 18, 4, 1, 256, 262144, True),
    "qwen2.5-coder-1.5b": (hf.Qwen2Config, 1536, 8960, 28, 12, 2, None, 151936, False),
}


def _empty(model: str):
    kind, hidden, mlp, layers, heads, kv_heads, head_dim, vocab, tied = SHAPES[model]
    config = kind(
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        **({} if head_dim is None else {"head_dim": head_dim}),
    )
    with torch.device("meta"):
        return hf.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model", list(SHAPES))
def test_every_recipe_gives_each_tensor_the_type_llama_cpp_gave_it(model):
    recorded = json.loads((RESULTS / f"gguf_llama_cpp_{model}.json").read_text())["rows"]
    rows, sizes, gqa = recipe_rows(_empty(model))
    files = {name: row for name, row in recorded.items() if name.startswith("llama.cpp ")}
    assert len(files) == 13
    for name, row in files.items():
        types = recipe_types(name.split()[1].lower(), rows, gqa, importance="imatrix" in name)
        counts = Counter(kind.upper() for kind in types.values())
        assert counts == {kind: n for kind, n in row["tensor_types"].items() if kind != "F32"}, name
        assert types["token_embd"].upper() == row["token_embd_type"], name
        bits = sum(BLOCK_TYPES[types[tensor]].bits_per_weight * size for tensor, size in sizes.items())
        assert bits / sum(sizes.values()) == pytest.approx(row["block_linear_bits"], abs=1e-9), name


def test_a_budget_is_the_smaller_of_the_plain_and_importance_matrix_files():
    model = _empty("qwen2.5-coder-1.5b")
    assert recipe_budget(model, "iq4_xs").bits == pytest.approx(4.2605, abs=1e-4)  # importance matrix: no Q5_K downs
    assert recipe_budget(model, "q4_0").bits == 4.5  # importance matrix: Q4_1 for the first downs
    budget = recipe_budget(model, "q4_k_m")
    assert budget.bits == pytest.approx(4.812, abs=1e-3) and budget.tables == {"token_embd": "q4_k", "output": "q6_k"}
    assert recipe_budget(_empty("smollm2-135m"), "q4_k_m").tables == {"token_embd": "q8_0"}  # tied, 576 wide


def test_an_unknown_recipe_or_tensor_is_refused():
    with pytest.raises(ConfigError, match="choose from"):
        recipe_types("q4_k_x", {"token_embd": 256}, 1.0)
    with pytest.raises(ConfigError, match="not a tensor"):
        recipe_types("q4_k_m", {"rope_freqs": 256}, 1.0)
