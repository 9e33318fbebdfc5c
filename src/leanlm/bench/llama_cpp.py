"""llama.cpp as a peer, through its Python bindings (`llama-cpp-python`, the `llama` extra: pip compiles llama.cpp
from source, 15-35 minutes on 2 cores, so it is a benchmark dependency, never a test one).

- `LlamaCpp(path).perplexity(windows)`: llama.cpp's own forward pass scores exactly the windows leanlm scores
  (`leanlm.evaluation.perplexity.perplexity_windows`), one context per window, so the two perplexities compare
  token for token.
- `quantize_gguf(source, out, kind, importance=...)`: llama.cpp's own quantizer (`llama_model_quantize`), with an
  importance matrix (per tensor, the mean square of each input column over calibration tokens, which is what
  llama.cpp's `llama-imatrix` tool accumulates) when one is given.
- `llama_cpp_inputs(model, input_types(model, path))`: the same model in PyTorch with the one rounding llama.cpp's
  CPU matmuls add to a stored weight: each linear's input rounded to the `vec_dot` type llama.cpp pairs with the
  weight's type in the GGUF file (`leanlm.formats.ggml_inputs`), so a leanlm perplexity can be split into the
  weights' part and this one.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from leanlm.errors import ConfigError
from leanlm.formats.ggml_inputs import INPUT_ROUNDING, ROUNDINGS

INSTALL = "pip install llama-cpp-python==0.3.36 (or the `llama` extra; it compiles llama.cpp, 15-35 min on 2 cores)"
QUANTIZE_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q3_k_m", "q4_k_m", "q5_k_m", "q6_k", "iq4_xs", "iq4_nl")
# The file type whose recipe stores its block linears in each block type (what `quantize_gguf(..., pure=True)` uses)
PURE_FILE_TYPE = {"q3_k": "q3_k_m", "q4_k": "q4_k_m", "q5_k": "q5_k_m"} | {
    kind: kind for kind in QUANTIZE_TYPES if not kind.endswith("_m")
}


def llama_cpp_module():
    """The bindings, or SystemExit with how to install them."""
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit(f"llama.cpp's Python bindings are not installed: {INSTALL}") from None
    return llama_cpp


def llama_cpp_version() -> str:
    return llama_cpp_module().__version__


class LlamaCpp:
    """One GGUF loaded by llama.cpp on the CPU, scoring whole windows of at most `context` tokens."""

    def __init__(self, path: str | os.PathLike, *, context: int = 512, threads: int = 2):
        llama_cpp = llama_cpp_module()
        self.path = Path(path)
        self.model = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=context,
            n_batch=context,
            n_ubatch=context,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=True,
            verbose=False,
        )

    def window_nll(self, ids: list[int]) -> float:
        """Sum over positions of -log P(ids[t+1] | ids[..t]), from llama.cpp's logits of one fresh context."""
        self.model.reset()  # the next eval starts at position 0 and clears the KV cache past it
        self.model.eval(ids)
        logits = torch.from_numpy(np.asarray(self.model.scores[: len(ids) - 1], dtype=np.float32))
        return F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()

    def decode(self, ids: list[int], prompt: int) -> None:
        """Read ids[:prompt] in one batch, then each later id alone: llama.cpp's decode step, once per token (the
        ids are given, so the work does not depend on what the model would sample)."""
        self.model.reset()
        self.model.eval(ids[:prompt])
        for token in ids[prompt:]:
            self.model.eval([token])

    def perplexity(self, windows: list[list[int]]) -> dict:
        """The protocol of `leanlm.evaluation.perplexity` on llama.cpp: the mean NLL over every predicted token;
        `window_nll` keeps each window's summed NLL, so that two files scored on the same windows can be compared
        window by window (`paired_difference`)."""
        sums, predicted, seconds = [], 0, 0.0
        for ids in windows:
            started = time.perf_counter()
            sums.append(self.window_nll(ids))
            seconds += time.perf_counter() - started
            predicted += len(ids) - 1
        return {
            "perplexity": math.exp(sum(sums) / predicted),
            "window_nll": sums,
            "tokens": predicted,
            "windows": len(windows),
            "seconds": seconds,
            "tokens_per_second": sum(map(len, windows)) / seconds,
        }


def paired_difference(ours: dict, theirs: dict) -> tuple[float, float] | None:
    """(mean NLL per token of `ours` minus `theirs`, its standard error) of two `LlamaCpp.perplexity` results on
    the same windows, window by window: the windows are the samples, so the error is what another draw of as many
    windows would move the difference by (a difference within two of them is noise). None unless both kept their
    windows' sums (`window_nll`) for the same number of windows, at least two."""
    a, b = ours.get("window_nll"), theirs.get("window_nll")
    if not a or not b or len(a) != len(b) or len(a) < 2 or ours["tokens"] != theirs["tokens"]:
        return None
    differences = np.asarray(a) - np.asarray(b)
    tokens = ours["tokens"]
    return float(differences.sum() / tokens), float(differences.std(ddof=1) * math.sqrt(len(a)) / tokens)


def input_types(model: torch.nn.Module, path: str | os.PathLike) -> dict[str, str]:
    """{module name: GGUF type} of every linear of `model` stored in the GGUF file at `path` (a tied output head
    reads the token embedding)."""
    import gguf

    from leanlm.models.architectures import gguf_tensor_names

    stored = {tensor.name: tensor.tensor_type.name.lower() for tensor in gguf.GGUFReader(path).tensors}
    names = gguf_tensor_names(model)
    types = {}
    for name, module in model.named_modules():
        if not hasattr(module, "in_features"):
            continue
        base = names.get_name(name)
        weight = stored.get(f"{base}.weight") or (stored.get("token_embd.weight") if base == "output" else None)
        if weight is not None:
            types[name] = weight
    return types


@contextlib.contextmanager
def llama_cpp_inputs(
    model: torch.nn.Module, types: dict[str, str], *, embedding_q8_0: bool = False
) -> Iterator[torch.nn.Module]:
    """`model` with each linear named in `types` ({module name: GGUF type of its stored weight}) seeing its input
    rounded as llama.cpp rounds it for that type (`INPUT_ROUNDING`), and (`embedding_q8_0`) its token embedding
    (and a tied output head) rounded to Q8_0 as a GGUF storing it so holds; restored on exit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    unknown = sorted({kind for kind in types.values() if kind not in INPUT_ROUNDING})
    if unknown:
        raise ConfigError(f"no llama.cpp input rounding known for GGUF type {', '.join(unknown)}")
    modules = dict(model.named_modules())
    handles = []
    embedding = model.get_input_embeddings()
    kept = embedding.weight
    try:
        if embedding_q8_0:
            weights = kept.detach().float().numpy()
            rounded = dequantize(quantize(weights, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
            embedding.weight = torch.nn.Parameter(torch.from_numpy(rounded.copy()).to(kept.dtype), requires_grad=False)
            if getattr(model.config, "tie_word_embeddings", False):
                model.get_output_embeddings().weight = embedding.weight
        for name, kind in types.items():
            rounding = INPUT_ROUNDING[kind]
            if rounding is not None:
                rule = ROUNDINGS[rounding]
                handles.append(
                    modules[name].register_forward_pre_hook(lambda module, args, rule=rule: (rule(args[0]), *args[1:]))
                )
        yield model
    finally:
        for handle in handles:
            handle.remove()
        if embedding_q8_0:
            embedding.weight = kept
            if getattr(model.config, "tie_word_embeddings", False):
                model.get_output_embeddings().weight = kept


def quantize_gguf(
    source: str | os.PathLike,
    out: str | os.PathLike,
    kind: str,
    *,
    threads: int = 2,
    importance: dict[str, np.ndarray] | None = None,
    pure: bool = False,
    tables: str | None = None,
) -> Path:
    """llama.cpp's own quantization of the GGUF `source` to `kind` (one of QUANTIZE_TYPES; with `pure`, a block type
    of PURE_FILE_TYPE given to every quantized tensor instead of the file type's recipe), optionally weighted by an
    importance matrix {GGUF tensor name: (input columns,) mean squared activation}, the token embedding and output
    head stored as block type `tables` if given; written atomically."""
    file_type = PURE_FILE_TYPE.get(kind) if pure else kind if kind in QUANTIZE_TYPES else None
    if file_type is None:
        known = PURE_FILE_TYPE if pure else QUANTIZE_TYPES
        raise ValueError(f"kind must be one of {', '.join(known)}, got {kind!r}")
    llama_cpp = llama_cpp_module()
    out = Path(out)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type.upper()}")
    params.pure = pure
    if tables is not None:
        params.token_embedding_type = params.output_tensor_type = getattr(llama_cpp, f"GGML_TYPE_{tables.upper()}")
    keep_alive = []  # the C side reads these arrays during the call
    if importance:
        entries = (llama_cpp.llama_cpp.llama_model_imatrix_data * (len(importance) + 1))()  # NULL-terminated
        for entry, (name, values) in zip(entries, importance.items()):
            values = np.ascontiguousarray(values, dtype=np.float32)
            keep_alive.append(values)
            entry.name = name.encode()
            entry.data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entry.size = values.size
        params.imatrix = entries
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params))
    if status != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not quantize {source} to {kind} (status {status})")
    os.replace(partial, out)
    return out
