"""Plots of the benchmark results (matplotlib, optional: ``pip install matplotlib``)."""
from __future__ import annotations

from typing import Dict, List, Sequence

_HINT = "`pip install matplotlib` (or `pip install lbcomm[bench]`)"
_TRAIN_LABELS = {"none": "no communication", "ddp": "DDP + AdamW", "fp16": "fp16_compress_hook",
                 "powersgd": "PowerSGD hook (rank 4)", "onebit_hook": "lbcomm onebit_hook",
                 "onebit_adam": "lbcomm OneBitAdam"}


def require_matplotlib() -> None:
    """Raise a RuntimeError naming the fix when matplotlib is missing (call before a long run)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RuntimeError(f"--plot needs matplotlib, which is not installed; install it with {_HINT}, or leave "
                           "out --plot") from None


def _pyplot():
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _size_label(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            v = nbytes / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{nbytes:.0f} B"


def plot_allreduce(rows: List[Dict], path: str, title: str) -> None:
    """Median time (log-log, p10-p90 band) and speedup over fp32 against the tensor size."""
    plt = _pyplot()
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=100)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for m in methods:
        rs = sorted((r for r in rows if r["method"] == m), key=lambda r: r["bytes"])
        x = [r["bytes"] for r in rs]
        ax_t.plot(x, [r["median_s"] * 1e3 for r in rs], marker="o", label=m)
        ax_t.fill_between(x, [r["p10_s"] * 1e3 for r in rs], [r["p90_s"] * 1e3 for r in rs], alpha=0.2)
        sp = [(r["bytes"], r["speedup_vs_fp32"]) for r in rs if r.get("speedup_vs_fp32")]
        if sp:
            ax_s.plot([a for a, _ in sp], [b for _, b in sp], marker="o", label=m)
    sizes = sorted({r["bytes"] for r in rows})
    for ax in (ax_t, ax_s):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([_size_label(s) for s in sizes], rotation=30, fontsize=8)
        ax.set_xlabel("fp32 tensor size")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("allreduce time, ms (median, p10-p90)")
    ax_s.set_ylabel("speedup over fp32 allreduce")
    ax_s.axhline(1.0, color="gray", lw=0.8)
    ax_t.legend(fontsize=8)
    ax_s.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_train(runs: Sequence[Dict], path: str, title: str) -> None:
    """Samples/s per method, one group of bars per bandwidth, speedup over DDP on top."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=100)
    methods = list(dict.fromkeys(r["method"] for run in runs for r in run["rows"]))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        xs, ys, labels = [], [], []
        for j, run in enumerate(runs):
            row = next((r for r in run["rows"] if r["method"] == m), None)
            if row is not None:
                xs.append(j + (i - (len(methods) - 1) / 2) * width)
                ys.append(row["samples_per_s"])
                labels.append(f"{row['speedup_vs_ddp']:.1f}x" if row.get("speedup_vs_ddp") else "")
        bars = ax.bar(xs, ys, width, label=_TRAIN_LABELS.get(m, m))
        for b, lab in zip(bars, labels):
            ax.annotate(lab, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels([run["bandwidth"] or "loopback" for run in runs])
    ax.set_ylabel("samples/s (all ranks)")
    ax.set_ylim(0, 1.35 * max(r["samples_per_s"] for run in runs for r in run["rows"]))  # room for the legend
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_model(grid: List[Dict], checks: List[Dict], path: str, title: str) -> None:
    """Predicted onebit speedup against the rank count, one line per bandwidth, with the
    measured points of this machine (`checks`: the speedup checks at the grid's size)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.6), dpi=100)
    for bw in list(dict.fromkeys(g["bandwidth"] for g in grid)):
        pts = sorted((g["world_size"], g["speedup"]) for g in grid if g["bandwidth"] == bw)
        ax.plot([a for a, _ in pts], [b for _, b in pts], marker=".", label=f"model, {bw}")
    if checks:
        ax.scatter([c["world_size"] for c in checks], [c["measured_speedup"] for c in checks], color="k", zorder=5,
                   label="measured here (emulated, 2 cores)")
        ax.scatter([c["world_size"] for c in checks], [c["predicted_speedup"] for c in checks], facecolors="none",
                   edgecolors="k", marker="s", s=60, zorder=5, label="model of this machine")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks")
    ax.set_ylabel("onebit speedup over fp32")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_race(runs: Sequence[Dict], path: str, title: str) -> None:
    """Validation loss against clocked seconds, one line per method and one panel per
    bandwidth, with the target as a horizontal line."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4.2), dpi=100, squeeze=False)
    for ax, run in zip(axes[0], runs):
        for r in run["rows"]:
            style = "--" if r["family"] in ("diloco", "ddp", "bf16", "powersgd") else "-"
            ax.plot([c["time_s"] for c in r["curve"]], [c["val_loss"] for c in r["curve"]], style, marker=".",
                    markersize=3, label=r["method"] + (f" {r['speedup_vs_ddp']:.1f}x" if r["speedup_vs_ddp"] else ""))
        ax.axhline(run["target_loss"], color="k", lw=0.8, ls=":", label="target")
        if run.get("ddp_time_s"):
            ax.axvline(run["ddp_time_s"], color="gray", lw=0.8, ls=":")
        ax.set_xlim(left=0)
        ax.set_xlabel("clocked seconds (training only, slowest rank)")
        ax.set_ylabel("validation loss")
        losses = [c["val_loss"] for r in run["rows"] for c in r["curve"][1:]]
        if losses:
            ax.set_ylim(min(losses) - 0.05, run["target_loss"] + 3 * (run["target_loss"] - min(losses)) + 0.3)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        ax.set_title(f"{run['bandwidth']} links" if run["bandwidth"] else "loopback", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
