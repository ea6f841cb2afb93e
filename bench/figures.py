"""Pictures of the evidence: accuracy per method (bar charts) from bench.accuracy's JSON.

    python -m bench.figures [docs/results]     # re-draws the bar charts from accuracy.json

The calibration histograms and the sensitivity figure need the live calibrators,
so :mod:`bench.accuracy` draws those itself (with :func:`lq.report.histogram_figure`
and :meth:`lq.sensitivity.SensitivityResult.figure`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def cnn_bars(cnn: dict):
    """Grouped bars: test accuracy of every CNN row, one colour per dataset, FP32 as a dashed line."""
    plt = _plt()
    names = list(cnn)
    rows = list(next(iter(cnn.values()))["rows"])
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 4.6), squeeze=False)
    for ax, n in zip(axes[0], names, strict=True):
        vals = [cnn[n]["rows"][r].get("acc") for r in rows]
        fp = cnn[n]["rows"]["FP32"]["acc"]
        ys = list(range(len(rows)))[::-1]
        colors = ["#444444" if r == "FP32" else ("tab:purple" if "W4" in r else
                                                   ("tab:green" if "QAT" in r else "tab:blue")) for r in rows]
        ax.barh(ys, [100 * (v or 0) for v in vals], color=colors)
        lo = min(100 * v for v in vals if v is not None)
        ax.set_xlim(max(0.0, lo - 3), 100.0)
        ax.axvline(100 * fp, color="black", linestyle="--", linewidth=0.8)
        for y, v in zip(ys, vals, strict=True):
            ax.text(ax.get_xlim()[0] + 0.1, y, "failed" if v is None else f"{100 * v:.2f}", va="center",
                    fontsize=7, color="white" if v is not None else "black")
        ax.set_yticks(ys)
        ax.set_yticklabels(rows, fontsize=7)
        ax.set_xlabel("test accuracy %")
        ax.set_title(f"SmallCNN on {n} ({cnn[n]['n_test']} test images)", fontsize=9)
    fig.tight_layout()
    return fig


def minilm_bars(m: dict):
    """Mean cosine to FP32 (with the min as a marker) and sentiment accuracy per MiniLM row."""
    plt = _plt()
    rows = [r for r in m["rows"] if r != "FP32"]
    ys = list(range(len(rows)))[::-1]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 0.38 * len(rows) + 1.8), sharey=True)
    mean = [m["rows"][r]["mean_cos"] for r in rows]
    mn = [m["rows"][r]["min_cos"] for r in rows]
    colors = ["tab:gray" if "torch.ao" in r else ("tab:orange" if "weight-only" in r else
                                                   ("tab:green" if "sensitivity" in r else "tab:blue")) for r in rows]
    a1.barh(ys, mean, color=colors)
    a1.scatter(mn, ys, marker="|", color="black", s=80, label="min cosine", zorder=3)
    a1.axvline(0.99, color="red", linestyle="--", linewidth=0.8, label="target 0.99")
    a1.set_xlim(max(0.0, min(mn) - 0.02), 1.0)
    a1.set_xlabel("cosine to FP32 embeddings (bar: mean)")
    a1.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=2, frameon=False)
    for y, v in zip(ys, mean, strict=True):
        a1.text(a1.get_xlim()[0] + 0.002, y, f"{v:.4f}", va="center", fontsize=7, color="white")
    fp = m["rows"]["FP32"]["sentiment_acc"]
    acc = [100 * m["rows"][r]["sentiment_acc"] for r in rows]
    a2.barh(ys, acc, color=colors)
    a2.axvline(100 * fp, color="black", linestyle="--", linewidth=0.8, label=f"FP32 {100 * fp:.1f}%")
    a2.set_xlim(max(0.0, min(acc + [100 * fp]) - 5), max(acc + [100 * fp]) + 2)
    a2.set_xlabel("sentiment accuracy % (logistic regression, CV)")
    a2.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False)
    a1.set_yticks(ys)
    a1.set_yticklabels(rows, fontsize=7)
    fig.suptitle("all-MiniLM-L6-v2: INT8 recipes", fontsize=10, y=0.995)
    fig.tight_layout()
    return fig


def accuracy_figures(results: dict, out: Path) -> list[Path]:
    plt = _plt()
    files = []
    if results.get("cnn"):
        fig = cnn_bars(results["cnn"])
        files.append(out / "accuracy_cnn.png")
        fig.savefig(files[-1], dpi=90)
        plt.close(fig)
    if results.get("minilm"):
        fig = minilm_bars(results["minilm"])
        files.append(out / "accuracy_minilm.png")
        fig.savefig(files[-1], dpi=90)
        plt.close(fig)
    return files


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else Path("docs/results")
    results = json.loads((out / "accuracy.json").read_text())
    for f in accuracy_figures(results, out):
        print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
