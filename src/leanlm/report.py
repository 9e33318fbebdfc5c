"""Plain-text tables for the terminal (and for pasting into the README)."""

from __future__ import annotations

import textwrap


def format_value(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 1e5 else f"{value:.3g}"
    return str(value)


def format_table(headers: list[str], rows: list[list], markdown: bool = False) -> str:
    cells = [[format_value(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(values):
        padded = [v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths))]
        return ("| " + " | ".join(padded) + " |") if markdown else "  ".join(padded)

    rule = ("|" + "|".join("-" * (w + 2) for w in widths) + "|") if markdown else "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in cells)])


def save_figure(fig, path, title: str | None = None) -> None:
    """Every PNG leanlm writes: a small suptitle (the model and its weights note), tight layout, 110 dpi; the
    figure is closed so long benchmark runs do not accumulate them."""
    import matplotlib.pyplot as plt

    if title:  # wrapped to the figure's width (about 14 characters an inch at 9 pt), or long notes run off it
        width = max(40, int(fig.get_figwidth() * 14))
        fig.suptitle("\n".join(textwrap.wrap(title, width)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_training_curves(
    series: dict[str, list[float]], path, title: str, ylabel: str = "loss", reference: dict[str, float] | None = None
) -> None:
    """Per-step curves (raw, faint) with a moving mean over 1/20 of the steps, and dashed reference levels: the
    loss curves of fine-tuning and of CushionCache's prefix tuning."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(series), figsize=(6 * len(series), 3.6), squeeze=False)
    for axis, (name, values) in zip(axes[0], series.items()):
        steps = range(1, len(values) + 1)
        (line,) = axis.plot(steps, values, linewidth=0.8, alpha=0.4, label=name)
        window = max(1, len(values) // 20)
        if len(values) >= window > 1:
            means = [sum(values[i - window : i]) / window for i in range(window, len(values) + 1)]
            axis.plot(range(window, len(values) + 1), means, color=line.get_color(), label=f"mean of {window}")
        for label, level in (reference or {}).items():
            axis.axhline(level, color="black", linestyle="--", linewidth=0.8, label=label)
        axis.set_xlabel("step")
        axis.set_ylabel(name if len(series) > 1 else ylabel)
        axis.legend(fontsize=8)
    save_figure(fig, path, title)
