"""CushionCache (Son et al. 2024): a short prefix, kept as per-layer keys and values in front of every input, that
becomes the model's attention sink so that the following tokens no longer carry activation outliers and
per-tensor (even static) W8A8 works.

1. `search_cushion`: greedy search over hard tokens (section 4.1). Tokens are appended one at a time, each the
   candidate that minimises the activation quantization error of sampled text after the prefix; the search
   stops when the best candidate cuts the error by less than `min_improvement` (tau) or at `max_length`.
   The paper scores the whole vocabulary; on this CPU a step over 49K tokens takes hours, so candidates are a
   stated pool: the most frequent tokens of the search text plus the tokenizer's special tokens.
2. `tune_cushion`: quantization-aware prefix tuning (section 4.2): the prefix's keys and values are trained with
   the model frozen, loss = next-token cross-entropy + lambda * activation quantization error, the quantizer's
   scale and zero point detached (stop-gradient).
3. `attach_cushion`: every forward of the model gets a fresh SinkCache whose sink slots hold the cushion
   (`window=None`: the prefix stays, the rest is dense), so the cushion goes through the same cache path as
   StreamingLLM and the new tokens get positions p, p+1, ... from the same position hook.

The error (eq. 6, summed over blocks): for every quantizable linear's input, the mean squared error of
per-tensor asymmetric 8-bit min-max quantization, with the range taken over the tokens after the prefix only
(the paper: "the scaling factor and zero-point are determined for x only"). The linear inputs are the tensors
W8A8 quantizes (the notes' reading; the residual stream peaks elsewhere). Tau and lambda were lost from the
paper's text; the defaults here are choices, stated as such.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn
from tqdm.auto import tqdm

from leanlm.cache.prefix import (
    Cushion,
    attach_cushion,
    check_cushion_support,
    cushion_keys_values,
    cushion_problem,
    load_cushion,
    prefix_cache,
)
from leanlm.data import calibration_batches, plain_text
from leanlm.data.tokens import token_ids
from leanlm.errors import ConfigError
from leanlm.methods.blocks import frozen_parameters, observe_inputs
from leanlm.methods.quantize import Calibration, QuantRun, quantize_, register_after_load, register_method
from leanlm.methods.w8a8 import W8A8Config
from leanlm.models.architectures import iter_quantizable_linears
from leanlm.optim import AdamW
from leanlm.settings import check_seed, option


@dataclass(frozen=True)
class CushionConfig:
    candidates: int = option(
        512,
        "candidate tokens per search step: the most frequent of the search text plus "
        "special tokens (the paper searches the whole vocabulary)",
        flag="--cushion-candidates",
    )
    max_length: int = option(4, "prefix tokens at most", flag="--cushion-max-length")
    min_improvement: float = option(
        0.1,
        "tau: the error cut a token must bring to be appended (the paper's value "
        "was lost; below 0 appends up to max_length tokens whatever they do)",
        flag="--cushion-min-improvement",
    )
    sample_tokens: int = option(64, "tokens of each search sample", cli=False)
    search_samples: int = option(
        2, "samples scored per step (the paper draws one; more resists a lucky sample)", cli=False
    )
    batch_size: int = option(32, "candidates per forward", cli=False)
    initial: tuple[int, ...] = option((), "token ids the search starts from (e.g. the model's BOS)", cli=False)
    initial_text: str = option(
        "", "text the search starts from (e.g. a newline), tokenized by the model's tokenizer", flag="--cushion-init"
    )
    tune_steps: int = option(0, "quantization-aware prefix-tuning steps after the search", flag="--cushion-tune-steps")
    tune_lr: float = option(1e-3, "prefix-tuning learning rate", cli=False)
    tune_lambda: float = option(
        1e-3,
        "lambda: weight of the quantization error in the tuning loss (the paper's value was lost)",
        flag="--cushion-lambda",
    )
    tune_batch_size: int = option(4, "prefix-tuning batch", cli=False)
    tune_seq_len: int = option(256, "prefix-tuning sequence length", cli=False)
    source: str = option("lambada-dev", "search and tuning text (never an evaluation set)", cli=False)
    seed: int = option(0, "seed of the search samples and tuning batches")

    def __post_init__(self):
        check_seed(self.seed)
        for name in (
            "candidates",
            "max_length",
            "sample_tokens",
            "search_samples",
            "batch_size",
            "tune_batch_size",
            "tune_seq_len",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"cushion {name.replace('_', ' ')} must be at least 1, got {getattr(self, name)}")
        if not self.min_improvement < 1.0:  # 1 or more could never be met: no search would append anything
            raise ConfigError(f"cushion min improvement must be below 1, got {self.min_improvement}")
        if self.tune_steps < 0 or self.tune_lambda < 0:
            raise ConfigError("cushion tune steps and lambda must be 0 or more")


@contextmanager
def quantization_error_probe(model: nn.Module, skip: int = 0, detach: bool = True):
    """Hooks on every quantizable linear: yields a list that collects, per forward, each linear's per-sequence
    mean squared error of per-tensor asymmetric 8-bit quantization of its input, over positions >= `skip`."""
    errors: list[torch.Tensor] = []
    batch: list[int] = []  # the sequences of the current forward, from the first (batch, length, width) input

    def record(name: str, inputs: torch.Tensor) -> None:
        if inputs.ndim == 3:
            batch[:] = [inputs.shape[0]]
        else:  # OPT's MLP reads its tokens flattened to (batch * length, width)
            inputs = inputs.reshape(batch[0], -1, inputs.shape[-1])
        x = inputs[:, skip:].float()
        flat = x.reshape(x.shape[0], -1)
        low, high = flat.amin(dim=1, keepdim=True), flat.amax(dim=1, keepdim=True)
        scale = ((high - low) / 255).clamp(min=1e-8)
        zero = torch.round(-low / scale)
        if detach:  # stop-gradient on the quantizer's scale and zero point
            scale, zero = scale.detach(), zero.detach()
        quantized = (torch.clamp(torch.round(flat / scale) + zero, 0, 255) - zero) * scale
        errors.append((flat - quantized).square().mean(dim=1))

    with observe_inputs(iter_quantizable_linears(model), record):
        yield errors


def _errors_after(model: nn.Module, prefix: Cushion | None, inputs: torch.Tensor, skip: int) -> torch.Tensor:
    """Summed quantization error per sequence of `inputs` (batch, length) run after `prefix`."""
    cache = prefix_cache(model, prefix, inputs.shape[0])
    start = 0 if prefix is None else prefix.length
    positions = torch.arange(start, start + inputs.shape[1]).expand(inputs.shape[0], -1)
    with quantization_error_probe(model, skip) as errors, torch.inference_mode():
        model.base_model(input_ids=inputs, past_key_values=cache, position_ids=positions, use_cache=False)
    return torch.stack(errors).sum(dim=0)


def candidate_pool(tokenizer, text: str, size: int) -> list[int]:
    """The tokenizer's special tokens and newline, then the most frequent tokens of `text`, `size` in all."""
    special = [i for i in tokenizer.all_special_ids if i is not None]
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    counts = Counter(token_ids(tokenizer, text))
    pool = list(dict.fromkeys([*special, *newline, *(token for token, _ in counts.most_common())]))
    return pool[:size]


def search_cushion(
    model: nn.Module, tokenizer, config: CushionConfig = CushionConfig(), progress: bool = True
) -> Cushion:
    """Greedy prefix search (section 4.1) on the float model."""
    check_cushion_support(model)
    started = time.perf_counter()
    text = plain_text(config.source)
    pool = torch.tensor(candidate_pool(tokenizer, text, config.candidates))
    generator = torch.Generator().manual_seed(config.seed)
    tokens = list(config.initial)
    history = []
    model_was_training = model.training
    model.eval()
    for step in range(config.max_length - len(tokens)):
        current = Cushion(tokens, *cushion_keys_values(model, tokens)) if tokens else None
        samples = calibration_batches(
            tokenizer,
            config.search_samples,
            config.sample_tokens,
            seed=int(torch.randint(0, 2**31, (1,), generator=generator)),
            source=config.source,
        )
        baseline = sum(_errors_after(model, current, sample[None], skip=0).item() for sample in samples)
        scores = torch.zeros(len(pool))
        bar = tqdm(
            range(0, len(pool), config.batch_size),
            desc=f"cushion search, token {len(tokens) + 1}",
            unit="batch",
            disable=not progress,
            leave=False,
        )
        for start in bar:
            candidates = pool[start : start + config.batch_size]
            for sample in samples:
                inputs = torch.cat([candidates[:, None], sample.expand(len(candidates), -1)], dim=1)
                scores[start : start + len(candidates)] += _errors_after(model, current, inputs, skip=1)
        best = int(scores.argmin())
        improvement = 1 - scores[best].item() / baseline if baseline > 0 else 0.0
        history.append(
            {
                "step": step + 1,
                "error_before": baseline,
                "best_token": int(pool[best]),
                "best_text": tokenizer.decode([int(pool[best])]),
                "error_after": scores[best].item(),
                "improvement": improvement,
            }
        )
        if improvement < config.min_improvement:
            break
        tokens.append(int(pool[best]))
    model.train(model_was_training)
    keys, values = cushion_keys_values(model, tokens)
    record = {
        "tokens": tokens,
        "text": tokenizer.decode(tokens),
        "search_seconds": time.perf_counter() - started,
        "candidates": len(pool),
        "history": history,
        "config": asdict(config),
    }
    return Cushion(tokens, keys, values, record)


def tune_cushion(
    model: nn.Module, tokenizer, cushion: Cushion, config: CushionConfig, progress: bool = True
) -> Cushion:
    """Quantization-aware prefix tuning (section 4.2): returns a cushion with trained keys and values."""
    if config.tune_steps == 0:
        return cushion
    if cushion.length == 0:
        raise ConfigError("prefix tuning needs a cushion of at least one token (the search found none)")
    started = time.perf_counter()
    keys = [nn.Parameter(k.clone()) for k in cushion.keys]
    values = [nn.Parameter(v.clone()) for v in cushion.values]
    optimizer = AdamW(keys + values, lr=config.tune_lr, state_bits=32)
    batches = calibration_batches(
        tokenizer,
        config.tune_steps * config.tune_batch_size,
        config.tune_seq_len,
        seed=config.seed + 1,
        source=config.source,
    )
    curve = []
    with frozen_parameters(model):
        for step in tqdm(range(config.tune_steps), desc="cushion tuning", unit="step", disable=not progress):
            ids = batches[step * config.tune_batch_size : (step + 1) * config.tune_batch_size]
            trainable = Cushion(cushion.tokens, keys, values)
            cache = prefix_cache(model, trainable, len(ids))
            positions = torch.arange(cushion.length, cushion.length + ids.shape[1]).expand(len(ids), -1)
            with quantization_error_probe(model) as errors:
                logits = model(input_ids=ids, past_key_values=cache, position_ids=positions, use_cache=False).logits
            cross_entropy = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
            )
            quantization = torch.stack(errors).sum(dim=0).mean()
            loss = cross_entropy + config.tune_lambda * quantization
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            curve.append({"cross_entropy": cross_entropy.item(), "quantization_error": quantization.item()})
    record = {
        **cushion.record,
        "tuning": {"steps": config.tune_steps, "seconds": time.perf_counter() - started, "curve": curve},
    }
    return Cushion(cushion.tokens, [k.detach() for k in keys], [v.detach() for v in values], record)


@register_method(CushionConfig, "cushion", "transform", followed_by=(W8A8Config,), architecture_problem=cushion_problem)
def _cushion(model: nn.Module, config: CushionConfig, run: QuantRun) -> dict:
    """Search (and tune) a cushion on the float model and attach it, so that the steps after it (SmoothQuant's
    statistics, static ranges) see only the tokens that follow it."""
    tokenizer = run.data(config).tokenizer
    if config.initial_text and not config.initial:
        config = replace(config, initial=tuple(tokenizer(config.initial_text, add_special_tokens=False)["input_ids"]))
    cushion = tune_cushion(model, tokenizer, search_cushion(model, tokenizer, config), config)
    attach_cushion(model, cushion)
    run.stats = None  # statistics observed without the cushion no longer describe the model
    return {
        "cushion": {
            "length": cushion.length,
            **{k: v for k, v in cushion.record.items() if k != "config"},
            "config": asdict(config),
        }
    }


@register_after_load
def _reattach_cushion(model: nn.Module, record: dict, directory) -> None:
    if record.get("cushion"):
        attach_cushion(model, load_cushion(directory))


def cushioned_copy(
    model: nn.Module, cushion: Cushion | None, steps: list | None = None, calibration: Calibration | None = None
) -> tuple[nn.Module, dict]:
    """One row of a with/without-cushion comparison: a copy of the float `model` with `cushion` attached (None:
    none) and, given `steps` (e.g. [SmoothQuantConfig(), W8A8Config("O3")]), quantized with it in place.
    Returns (the copy, the record; {} in float)."""
    model = copy.deepcopy(model)
    if cushion is not None:
        attach_cushion(model, cushion)
    return model, (quantize_(model, steps, calibration=calibration) if steps else {})
