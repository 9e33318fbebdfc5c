"""The fine-tuning loop for LoRA / QLoRA: packed blocks, AdamW (8-bit states by default), constant learning
rate after a linear warm-up and gradient clipping (QLoRA's recipe), atomic checkpoints that resume bit-exactly.

A checkpoint (`OUT/checkpoint/`) holds the adapters, the optimizer state and the RNG state as safetensors and
the step and loss history as JSON. The batch of step t is a pure function of (seed, t) - every epoch is a
seeded permutation of the blocks - so an interrupted run that resumes from step k sees exactly the batches and
dropout masks an uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from leanlm.bench.harness import peak_memory, weight_bytes
from leanlm.errors import ConfigError, CorruptModelError, first_line
from leanlm.memory import return_freed_memory_at_once
from leanlm.methods.qlora import (
    LoRAConfig,
    adapter_tensors,
    load_adapter_tensors_,
    save_adapters,
)
from leanlm.optim import AdamW
from leanlm.report import plot_training_curves
from leanlm.settings import check_seed, option
from leanlm.training.data import Document, batch_indices, training_blocks
from leanlm.training.loss import causal_lm_loss

CHECKPOINT_DIR = "checkpoint"
LOSS_CURVE = "loss_curve.png"


@dataclass(frozen=True)
class FinetuneSettings:
    max_steps: int = option(200, "optimizer steps")
    batch_size: int = option(4, "blocks per step")
    seq_len: int = option(256, "tokens per training block")
    lr: float = option(2e-4, "learning rate (QLoRA's published rate for small models)")
    warmup_fraction: float = option(0.03, "share of the steps the learning rate warms up over", cli=False)
    grad_clip: float = option(0.3, "max gradient norm (QLoRA)", cli=False)
    weight_decay: float = option(0.0, "AdamW weight decay", cli=False)
    held_out_fraction: float = option(0.05, "share of documents held out", flag="--held-out")
    max_eval_blocks: int = option(64, "held-out blocks scored at most", cli=False)
    save_every: int = option(50, "steps between checkpoints")
    seed: int = option(0, "seed of the data order, dropout and adapter initialisation")
    gradient_checkpointing: bool = option(
        True,
        "recompute block activations in backward (less memory, ~30% more time)",
        off="keep block activations for backward (more memory, less time)",
    )
    keep_freed_memory: bool = option(
        False,
        "let the C library keep freed activation memory for reuse (faster, "
        "but training's peak resident memory is then 2-3x its live tensors)",
    )
    optimizer_bits: int = option(8, "AdamW moment storage: block-wise 8-bit or float32", choices=(8, 32))

    def __post_init__(self):
        for name in ("max_steps", "batch_size", "save_every", "max_eval_blocks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise ConfigError(f"seq_len must be at least 2, got {self.seq_len}")
        if not 0.0 < self.held_out_fraction < 1.0:
            raise ConfigError(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")
        if self.optimizer_bits not in (8, 32):
            raise ConfigError(f"optimizer_bits must be 8 or 32, got {self.optimizer_bits}")
        check_seed(self.seed)

    @staticmethod
    def ignored_on_resume() -> set[str]:
        """What may change when a run resumes and it is still the same run: the step budget and how memory is
        spent (recomputed activations are the same numbers)."""
        return {"max_steps", "gradient_checkpointing", "keep_freed_memory"}


@torch.no_grad()
def block_perplexity(model: nn.Module, blocks: torch.Tensor, batch_size: int = 4) -> float:
    """exp(mean next-token NLL) over every predicted token of the blocks."""
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        batch = blocks[start : start + batch_size]
        total += causal_lm_loss(model, batch).item() * batch[:, 1:].numel()
        count += batch[:, 1:].numel()
    return math.exp(total / count)


def _write_checkpoint(out: Path, model, optimizer: AdamW, state: dict) -> None:
    """Written beside the old one and swapped in by renames, so a kill at any moment leaves a whole checkpoint."""
    final, fresh, stale = out / CHECKPOINT_DIR, out / f"{CHECKPOINT_DIR}.new", out / f"{CHECKPOINT_DIR}.old"
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir(parents=True)
    save_file(adapter_tensors(model), str(fresh / "adapters.safetensors"))
    save_file(optimizer.state_tensors(), str(fresh / "optimizer.safetensors"))
    save_file({"torch": torch.get_rng_state()}, str(fresh / "rng.safetensors"))
    (fresh / "trainer_state.json").write_text(json.dumps(state) + "\n")
    if final.exists():
        shutil.rmtree(stale, ignore_errors=True)
        final.rename(stale)
    fresh.rename(final)
    shutil.rmtree(stale, ignore_errors=True)


def _recover_checkpoint(out: Path) -> Path | None:
    """The newest whole checkpoint; a kill between the two renames leaves it under `.old`."""
    for name in (CHECKPOINT_DIR, f"{CHECKPOINT_DIR}.old"):
        if (out / name / "trainer_state.json").is_file():
            return out / name
    return None


def last_checkpoint_step(out: str | os.PathLike) -> int | None:
    """The step of the newest whole checkpoint in `out`, or None."""
    checkpoint = _recover_checkpoint(Path(out))
    return None if checkpoint is None else _read_state(checkpoint)["step"]


def _read_state(checkpoint: Path) -> dict:
    path = checkpoint / "trainer_state.json"
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        int(state["step"]), dict(state["settings"]), dict(state["lora"]), list(state["losses"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        raise CorruptModelError(f"{path} cannot be read ({first_line(error)}); start a new run elsewhere") from None
    return state


def _read_tensors(checkpoint: Path, name: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(checkpoint / name))
    except Exception as error:  # safetensors raises its own error types for a damaged file
        raise CorruptModelError(f"{checkpoint / name} cannot be read ({first_line(error)})") from None


def data_fingerprint(documents: list[Document]) -> str:
    """The sha256 of the training documents as read: a resumed run must see the same data."""
    return hashlib.sha256(json.dumps(documents, ensure_ascii=False).encode()).hexdigest()


def check_resumable(
    out: str | os.PathLike, settings: FinetuneSettings, lora: LoRAConfig, data: str, base_model: str, resume: bool
) -> tuple[Path, dict] | None:
    """(the checkpoint a run writing to `out` continues, its state), or None for a new run, after checking that
    resuming it is exactly the same run: the same settings, adapters, base model and data (`data_fingerprint`)."""
    out = Path(out)
    checkpoint = _recover_checkpoint(out)
    if checkpoint is not None and not resume:
        raise ConfigError(f"{out} already holds a training checkpoint; resume it, or write to another directory")
    if checkpoint is None and resume:
        raise ConfigError(f"resume: {out} holds no training checkpoint")
    if checkpoint is None:
        return None
    state = _read_state(checkpoint)
    ignored = settings.ignored_on_resume()
    had = {**state["settings"], **{f"lora {key}": value for key, value in state["lora"].items()}}
    has = {**asdict(settings), **{f"lora {key}": value for key, value in asdict(lora).items()}}
    changed = [key for key in dict.fromkeys([*had, *has]) if key not in ignored and had.get(key) != has.get(key)]
    if changed:
        raise ConfigError(
            f"the checkpoint in {out} was trained with other settings; resume with the same options ("
            + ", ".join(f"{key}: it has {had.get(key)!r}, this run {has.get(key)!r}" for key in changed[:3])
            + ")"
        )
    if state.get("base_model") != base_model:
        raise ConfigError(f"the checkpoint in {out} trains {state.get('base_model')!r}, not {base_model!r}")
    if state.get("data_sha256") != data:
        raise ConfigError(
            f"the checkpoint in {out} was trained on other data (sha256 {str(state.get('data_sha256'))[:12]}... of "
            f"its documents; this data gives {data[:12]}...); resume with the same --data"
        )
    return checkpoint, state


def finetune(
    model: nn.Module,
    tokenizer,
    documents: list[Document],
    settings: FinetuneSettings,
    lora: LoRAConfig,
    out_dir: str | os.PathLike,
    base_model: str,
    resume: bool = False,
    progress: bool = True,
) -> dict:
    """Train the LoRA adapters of `model` (see `add_lora_`) on `documents`; write the PEFT adapter, the loss
    curve and a checkpoint to `out_dir`. Returns the record (losses, held-out perplexity, peak memory, ...)."""
    out = Path(out_dir)
    train_blocks, eval_blocks = training_blocks(
        tokenizer, documents, settings.seq_len, settings.held_out_fraction, settings.seed, settings.max_eval_blocks
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ConfigError("the model has no trainable parameters (call add_lora_ first)")
    optimizer = AdamW(trainable, lr=settings.lr, weight_decay=settings.weight_decay, state_bits=settings.optimizer_bits)
    losses: list[float] = []
    start_step, train_seconds = 0, 0.0
    data = data_fingerprint(documents)
    resumed = check_resumable(out, settings, lora, data, base_model, resume)
    if resumed is not None:
        checkpoint, state = resumed
        load_adapter_tensors_(model, _read_tensors(checkpoint, "adapters.safetensors"), str(checkpoint))
        try:
            optimizer.load_state_tensors(_read_tensors(checkpoint, "optimizer.safetensors"))
            torch.set_rng_state(_read_tensors(checkpoint, "rng.safetensors")["torch"])
        except (KeyError, ValueError, RuntimeError) as error:
            raise CorruptModelError(
                f"{checkpoint}: its optimizer or RNG state does not fit this run: {error}"
            ) from None
        start_step, losses, train_seconds = state["step"], state["losses"], state["train_seconds"]

    warmup_steps = max(1, round(settings.warmup_fraction * settings.max_steps))
    if not settings.keep_freed_memory:
        return_freed_memory_at_once()
    if settings.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()

    def save(step: int) -> None:
        _write_checkpoint(
            out,
            model,
            optimizer,
            {
                "step": step,
                "losses": losses,
                "train_seconds": train_seconds,
                "settings": asdict(settings),
                "lora": asdict(lora),
                "base_model": base_model,
                "data_sha256": data,
            },
        )

    bar = tqdm(
        range(start_step, settings.max_steps),
        desc="fine-tuning",
        unit="step",
        disable=not progress,
        initial=start_step,
        total=settings.max_steps,
    )
    with peak_memory() as memory:
        for step in bar:
            started = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = settings.lr * min(1.0, (step + 1) / warmup_steps)
            batch = train_blocks[batch_indices(step, settings.batch_size, len(train_blocks), settings.seed)]
            loss = causal_lm_loss(model, batch)  # never the whole batch's logits at once
            loss.backward()
            nn.utils.clip_grad_norm_(trainable, settings.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            train_seconds += time.perf_counter() - started
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if (step + 1) % settings.save_every == 0 or step + 1 == settings.max_steps:
                save(step + 1)
        model.eval()
        eval_ppl = block_perplexity(model, eval_blocks)
    if settings.gradient_checkpointing:
        model.gradient_checkpointing_disable()

    save_adapters(model, lora, out, base_model)
    steps_run = settings.max_steps
    record = {
        "train_loss_first": losses[0] if losses else None,
        "train_loss_last": losses[-1] if losses else None,
        "eval_perplexity": eval_ppl,
        "peak_memory_bytes": memory.peak_bytes,
        "steps": steps_run,
        "tokens_per_second": steps_run * settings.batch_size * settings.seq_len / train_seconds
        if train_seconds
        else None,
        "optimizer_state_bytes": optimizer.state_bytes(),
        "model_bytes": weight_bytes(model),  # base (as stored: k-bit codes + constants) + adapters
        "trainable_parameters": sum(p.numel() for p in trainable),
        "train_blocks": len(train_blocks),
        "held_out_blocks": len(eval_blocks),
        "settings": asdict(settings),
        "lora": asdict(lora),
        "losses": losses,
    }
    plot_training_curves(
        {"cross-entropy": losses},
        out / LOSS_CURVE,
        f"{lora.method} ({lora.base} base), r={lora.rank}",
        reference={f"held-out (ppl {eval_ppl:.2f})": math.log(eval_ppl)},
    )
    return record
