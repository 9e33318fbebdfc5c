"""The quick measurements behind `leanlm bench`: leanlm's quantized linears and models side by side with FP32,
in one process (the full studies, with peers and plots, are the scripts in benchmarks/)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from leanlm.bench.harness import float_paths, time_call, time_modules, time_prefill
from leanlm.nn import KbitLinear, W8A8Linear

LINEAR_ROWS = (1, 16, 64, 512)


def linear_variants(linear: nn.Linear) -> dict[str, nn.Module]:
    weight, bias = linear.weight.detach(), linear.bias
    return {
        **float_paths(linear),
        "w8a8 per-token (fbgemm)": W8A8Linear.from_float(weight, bias, "per_channel", activation="per_token"),
        "llm-int8 (threshold 6)": W8A8Linear.from_float(
            weight, bias, "per_channel", activation="per_token", outlier_threshold=6.0
        ),
        "nf4 block 64": KbitLinear.from_float(weight, bias, "nf", 4, 64),
        "nf4 + double quant": KbitLinear.from_float(weight, bias, "nf", 4, 64, double_quant=True),
    }


def linear_suite(size: int = 4096, rows: tuple[int, ...] = LINEAR_ROWS, repeats: int = 5) -> dict:
    """Median ms, relative error and speed-up over FP32 of one size x size linear at each M."""
    torch.manual_seed(0)
    linear = nn.Linear(size, size, bias=False)
    variants = linear_variants(linear)
    results = {}
    for m in rows:
        x = torch.randn(m, size)
        with torch.inference_mode():
            reference = linear(x)
        results[str(m)] = time_modules(variants, x, reference, repeats)
    return {"size": size, "rows": {str(m): results[str(m)] for m in rows}}


def model_suite(loaded, prompt_tokens: int = 256, decode_tokens: int = 16, repeats: int = 3) -> dict:
    """Prefill tokens/s and decode ms/token of the model in FP32, BF16, NF4 + double quantization and W8A8 O1."""
    from leanlm.methods import KbitConfig, W8A8Config, quantize_

    variants = {"fp32": loaded.model, "bf16": copy.deepcopy(loaded.model).to(torch.bfloat16)}
    nf4 = copy.deepcopy(loaded.model)
    quantize_(nf4, KbitConfig("nf", 4, 64, double_quant=True))
    variants["nf4 + double quant"] = nf4
    int8 = copy.deepcopy(loaded.model)
    quantize_(int8, W8A8Config(level="O1", weight_granularity="per_channel", quantize_bmm=False))
    variants["w8a8 O1"] = int8
    ids = torch.randint(0, loaded.tokenizer.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    prefill = time_prefill(variants, ids, repeats)
    for name, model in variants.items():

        def decode(model=model):
            output = model(input_ids=ids[:, :8], use_cache=True)
            cache, token = output.past_key_values, output.logits[:, -1:].argmax(-1)
            for _ in range(decode_tokens):
                output = model(input_ids=token, past_key_values=cache, use_cache=True)
                token = output.logits[:, -1:].argmax(-1)

        timing = time_call(decode, warmup=1, repeats=repeats)
        prefill[name]["decode_ms_per_token"] = timing.median * 1e3 / decode_tokens
    return {"prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens, "variants": prefill}
