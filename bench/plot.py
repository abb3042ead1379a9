"""TFLOP/s against seqlen, one line per implementation, one panel per (dtype, head dim, mask)
or, for a --variants report, per variant."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot_report(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({_panel(c) for c in report["cells"]})
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        cells = sorted((c for c in report["cells"] if _panel(c) == panel), key=lambda c: c["seqlen"])
        impls = [r["impl"] for r in cells[0]["results"]]
        for impl in impls:
            points = [(c["seqlen"], r["tflops"]) for c in cells for r in c["results"]
                      if r["impl"] == impl and "tflops" in r]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", label=impl, linewidth=2.5 if impl == "fa_gen" else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_title(_title(cells[0]))
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{report['device']}, commit {report['commit']}, {report['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


def _panel(cell: dict) -> tuple:
    return (cell["variant"],) if "variant" in cell else (cell["dtype"], cell["head_dim"], cell["causal"])


def _title(cell: dict) -> str:
    if "variant" in cell:
        return f"{cell['variant']} ({cell['dtype']} d={cell['head_dim']}, visible pairs)"
    return f"{cell['dtype']} d={cell['head_dim']} {'causal' if cell['causal'] else 'no mask'}"


if __name__ == "__main__":
    source = Path(sys.argv[1])
    print(plot_report(json.loads(source.read_text()), source.with_suffix(".png")))
