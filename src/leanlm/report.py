"""Plain-text tables for the terminal (and for pasting into the README)."""

from __future__ import annotations


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

    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
