"""TFLOP/s against seqlen, one line per implementation, one panel per (dtype, head dim, mask)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot_report(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(c["dtype"], c["head_dim"], c["causal"]) for c in report["cells"]})
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, (dtype, head_dim, causal) in zip(axes.flat, panels):
        cells = sorted((c for c in report["cells"]
                        if (c["dtype"], c["head_dim"], c["causal"]) == (dtype, head_dim, causal)),
                       key=lambda c: c["seqlen"])
        impls = [r["impl"] for r in cells[0]["results"]]
        for impl in impls:
            points = [(c["seqlen"], r["tflops"]) for c in cells for r in c["results"]
                      if r["impl"] == impl and "tflops" in r]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", label=impl, linewidth=2.5 if impl == "fa_gen" else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dtype} d={head_dim} {'causal' if causal else 'no mask'}")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"{report['device']}, commit {report['commit']}, {report['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


if __name__ == "__main__":
    source = Path(sys.argv[1])
    print(plot_report(json.loads(source.read_text()), source.with_suffix(".png")))
