"""The outlier-feature analysis of LLM.int8() (Dettmers' thesis section 2.3).

Hidden states analysed, per layer: the inputs of the attention projections (q/k/v, and o) and of the FFN
expansion (gate/up or fc1); the FFN contraction's input is left out, as in the chapter. A feature dimension h
is an outlier feature when all three criteria hold:
  1. magnitude: some |x_h| >= 6.0;
  2. layers: h reaches that magnitude in at least 25% of the transformer layers;
  3. positions: h reaches it in at least 6% of all sequence positions, across all analysed hidden states.
Reported as in Fig. 2.3: the percentage of layers, and of sequence positions (averaged over hidden states),
where at least one outlier feature reaches the magnitude, and the largest magnitude seen.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from leanlm.methods.blocks import observe_inputs
from leanlm.models.architectures import architecture_for, decoder_blocks, linear_weight_out_in
from leanlm.report import save_figure


@dataclass(frozen=True)
class OutlierCriteria:
    magnitude: float = 6.0
    layers_fraction: float = 0.25
    positions_fraction: float = 0.06


@dataclass
class OutlierReport:
    outlier_dims: list[int]
    layers_affected_pct: float
    tokens_affected_pct: float
    max_magnitude: float
    # (layers, hidden) per-dimension max |x| over the analysed inputs of each layer, for the heat map
    channel_absmax: torch.Tensor = field(repr=False)
    criteria: OutlierCriteria = field(default_factory=OutlierCriteria)

    def as_dict(self) -> dict:
        return {
            "outlier_dims": self.outlier_dims,
            "layers_affected_pct": self.layers_affected_pct,
            "tokens_affected_pct": self.tokens_affected_pct,
            "max_magnitude": self.max_magnitude,
            "criteria": vars(self.criteria),
            "layer_max_magnitude": self.channel_absmax.amax(dim=1).tolist(),
        }


def _analysed_inputs(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, module whose input is analysed): one of q/k/v (they share it), o, and the FFN expansion."""
    table = architecture_for(model)
    width = model.config.hidden_size
    picked = []
    for index, block in enumerate(decoder_blocks(model, table)):
        for path in (table.attention_inputs[0], table.attention_output, table.mlp_inputs[0]):
            module = block.get_submodule(path)
            in_features = module.weight.shape[0 if table.weight_layout == "in_out" else 1]
            if in_features == width:  # only hidden states of the model width share feature dimensions
                picked.append((index, module))
    return picked


def _run_with_hooks(
    model: nn.Module, batches: torch.Tensor, hooked: list[tuple[int, nn.Module]], hook_for, desc: str
) -> None:
    """Run `batches` through `model` with `hook_for(i, layer)(x)` seeing the input of the i-th (layer, module)."""
    observers = {i: hook_for(i, layer) for i, (layer, _) in enumerate(hooked)}
    with (
        observe_inputs(((i, module) for i, (_, module) in enumerate(hooked)), lambda i, x: observers[i](x)),
        torch.inference_mode(),
    ):
        for sample in tqdm(batches, desc=desc, unit="sample", leave=False):
            model(input_ids=sample[None], use_cache=False, logits_to_keep=1)


def analyze_outliers(
    model: nn.Module, batches: torch.Tensor, criteria: OutlierCriteria = OutlierCriteria()
) -> OutlierReport:
    """Two passes over `batches` (n, L): per-dimension statistics, then position coverage of the outliers."""
    layers = len(decoder_blocks(model))
    width = model.config.hidden_size
    inputs = _analysed_inputs(model)
    channel_absmax = torch.zeros(layers, width)
    hits = torch.zeros(len(inputs), width)  # positions with |x_h| >= magnitude, per analysed hidden state
    positions = [0]

    def statistics(state: int, layer: int):
        def hook(inputs):
            x = inputs.detach().reshape(-1, width).float().abs()
            channel_absmax[layer] = torch.maximum(channel_absmax[layer], x.amax(dim=0))
            hits[state] += (x >= criteria.magnitude).sum(dim=0)
            if state == 0:
                positions[0] += x.shape[0]

        return hook

    _run_with_hooks(model, batches, inputs, statistics, "outlier statistics")
    reaching = channel_absmax >= criteria.magnitude  # (layers, width)
    in_layers = reaching.float().mean(dim=0) >= criteria.layers_fraction
    in_positions = hits.sum(dim=0) / (positions[0] * len(inputs)) >= criteria.positions_fraction
    outlier_dims = torch.nonzero(reaching.any(dim=0) & in_layers & in_positions)[:, 0]

    covered = torch.zeros(len(inputs))

    def coverage(state: int, layer: int):
        def hook(inputs):
            x = inputs.detach().reshape(-1, width)[:, outlier_dims].abs()
            covered[state] += (x >= criteria.magnitude).any(dim=1).sum()

        return hook

    if outlier_dims.numel():
        _run_with_hooks(model, batches, inputs, coverage, "outlier coverage")
    layers_affected = reaching[:, outlier_dims].any(dim=1).float().mean().item() if outlier_dims.numel() else 0.0
    return OutlierReport(
        outlier_dims=outlier_dims.tolist(),
        layers_affected_pct=100 * layers_affected,
        tokens_affected_pct=100 * (covered / positions[0]).mean().item(),
        max_magnitude=channel_absmax.max().item(),
        channel_absmax=channel_absmax,
        criteria=criteria,
    )


def block_input_magnitudes(model: nn.Module, batches: torch.Tensor, top: int = 3) -> list[dict]:
    """Per decoder block, order statistics of |x| entering it (CushionCache Table 5 / Fig. 2): the `top` largest
    magnitudes, the top 10% point and the median of each sample of `batches` (n, L), averaged over the samples
    as the paper does (pooled, every top-k would be the first token's massive activation in k samples). A
    cushion attached to `model` sits in the KV cache, so its own positions are never counted."""
    blocks = decoder_blocks(model)
    per_sample: list[list[torch.Tensor]] = [[] for _ in blocks]  # per block: (top..., top 10%, median) rows

    def hook_for(index: int, layer: int):
        def hook(inputs):
            values = inputs.detach().abs().float().reshape(-1)
            per_sample[layer].append(
                torch.cat(
                    [
                        values.topk(top).values,
                        values.kthvalue(int(0.9 * values.numel())).values[None],
                        values.median()[None],
                    ]
                )
            )

        return hook

    _run_with_hooks(model, batches, list(enumerate(blocks)), hook_for, "block input magnitudes")
    statistics = []
    for rows in per_sample:
        mean = torch.stack(rows).mean(dim=0).tolist()
        statistics.append({"top": mean[:top], "top1": mean[0], "top10pct": mean[top], "median": mean[top + 1]})
    return statistics


def smoothing_view(model: nn.Module, batches: torch.Tensor, report: OutlierReport, alpha: float = 0.5) -> dict:
    """Thesis Fig. 3.2's data: per input channel, max|X| and max|W| of the q/k/v projection of the layer with
    the largest activation, before and after SmoothQuant's smoothing (on a copy of the model)."""
    from leanlm.methods import SmoothQuantConfig, collect_input_absmax, smooth_

    table = architecture_for(model)
    layer = int(report.channel_absmax.amax(dim=1).argmax())
    name = f"{table.blocks}.{layer}.{table.attention_inputs[0]}"
    stats = collect_input_absmax(model, batches)
    smoothed = copy.deepcopy(model)
    after = smooth_(smoothed, stats, SmoothQuantConfig(alpha=alpha)).input_absmax[name]

    def weight_absmax(source: nn.Module) -> torch.Tensor:
        return linear_weight_out_in(source.get_submodule(name), table).detach().abs().amax(dim=0)

    return {
        "name": name,
        "alpha": alpha,
        "x_before": stats[name],
        "x_after": after,
        "w_before": weight_absmax(model),
        "w_after": weight_absmax(smoothed),
    }


def plot_outliers(report: OutlierReport, path, title: str, smoothing: dict | None = None) -> None:
    """A per-layer heat map of channel magnitudes and, if given, Xiao's thesis Fig. 3.2's before/after-smoothing view
    of one linear: `smoothing` = {"name", "x_before", "x_after", "w_before", "w_after"} (per input channel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    panels = 2 if smoothing else 1
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 4.5), squeeze=False)
    heat = axes[0][0]
    image = heat.imshow(
        report.channel_absmax.clamp(min=1e-3).numpy(),
        aspect="auto",
        cmap="magma",
        norm=LogNorm(),
        interpolation="nearest",
    )
    fig.colorbar(image, ax=heat, label="max |x| over tokens")
    heat.set_xlabel("feature dimension")
    heat.set_ylabel("layer")
    dims = ", ".join(map(str, report.outlier_dims[:8])) or "none"
    heat.set_title(f"linear inputs (q/k/v, o, FFN in); outlier dims: {dims}", fontsize=9)
    if smoothing:
        ax = axes[0][1]
        for key, label in (
            ("x_before", "activation, before"),
            ("x_after", "activation, after"),
            ("w_before", "weight, before"),
            ("w_after", "weight, after"),
        ):
            ax.plot(smoothing[key].numpy(), label=label, linewidth=0.8, alpha=0.9)
        ax.set_yscale("log")
        ax.set_xlabel("input channel")
        ax.set_ylabel("max |value|")
        ax.set_title(f"SmoothQuant a={smoothing['alpha']}: {smoothing['name']}", fontsize=9)
        ax.legend(fontsize=8)
    save_figure(fig, path, title)
