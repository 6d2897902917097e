"""The tables and the plot of bench/convergence.py: final validation loss and the ratio of
each 1-bit optimizer to its full-precision twin, the block-size sweep, the bytes and
rounds each rank sent per step, the optimizer state per parameter, the loss curves.
"""
from __future__ import annotations

import math

import lbcomm

from .convergence_run import BASELINE, LABEL, TWIN
from .plotting import pyplot


def report(results, a, plot_path):
    by = {(r["kind"], r["block"]): r for r in results}
    default = lbcomm.config.DEFAULT_BLOCK_SIZE
    print(f"\nfinal validation loss ({a.final_eval_seqs} held-out windows of {a.ctx} bytes), {a.ranks} ranks, "
          f"global batch {a.batch} x {a.ctx} bytes, {a.steps} steps, freeze_step {a.freeze}")
    print(f"{'optimizer':<12}{'block_size':>11}{'val loss':>10}{'ratio to twin':>15}{'bytes sent/step':>17}"
          f"{'time':>8}")
    for r in results:
        base = by.get((TWIN.get(r["kind"]), None))
        ratio = f"{r['final'] / base['final']:.4f}" if base else "-"
        if r.get("diverged"):
            ratio = f"diverged@{r['diverged']}"
        print(f"{LABEL[r['kind']]:<12}{str(r['block'] if r['kind'] in TWIN else '-'):>11}{r['final']:>10.4f}"
              f"{ratio:>15}{r['sent_per_step']:>17,}{r['seconds']:>7.0f}s")
    print(f"\npairs at the default block size ({default}): val-loss ratio 1-bit / full precision")
    for kind, base in TWIN.items():
        if (kind, default) in by and (base, None) in by:
            ratio = by[(kind, default)]["final"] / by[(base, None)]["final"]
            verdict = "meets the target: at most 1 % worse" if ratio <= 1.01 else "MISSES the target (> 1 % worse)"
            print(f"  {LABEL[kind]} / {LABEL[base]}: {ratio:.4f}  ({verdict})")
    traffic_report(results, a)
    blocks = [b for b in a.blocks]
    print("\nblock size: val-loss ratio to the full-precision twin, and compression volume vs an fp32 allreduce")
    print(f"{'block_size':>11}{'OneBitAdam':>12}{'OneBitLamb':>12}{'bytes/step':>12}{'vs fp32':>9}")
    for b in blocks:
        cells = []
        for kind, base in BASELINE.items():
            r, r0 = by.get((kind, b)), by.get((base, None))
            cells.append(f"{r['final'] / r0['final']:.4f}" if r and r0 else "-")
        r = by.get(("onebit_adam", b)) or by.get(("onebit_lamb", b))
        fp32 = by.get(("adamw", None)) or by.get(("lamb", None))
        sent = r["sent_per_step"] if r else 0
        vs = f"{fp32['sent_per_step'] / sent:.1f}x" if r and fp32 and sent else "-"
        print(f"{str(b):>11}{cells[0]:>12}{cells[1]:>12}{sent:>12,}{vs:>9}")
    print("\noptimizer state per parameter (rank 0): resident tensors / serialized state_dict")
    for r in results:
        if r["kind"] in TWIN and r["block"] != default:
            continue
        print(f"  {LABEL[r['kind']]:<11} {r['state_bytes'] / r['params']:6.2f} B/param resident, "
              f"{r['checkpoint_bytes'] / r['params']:6.2f} B/param in the checkpoint"
              + (f", {r['masked']} zero-variance coordinates masked" if r["kind"] in TWIN else ""))
    if plot_path:
        plot(results, a, plot_path)


def traffic_report(results, a):
    """Bytes and communication rounds per step that rank 0 sent, counted: over the whole
    run and over the steps after freeze_step (OneBitAdam's compression stage; ZeroOneAdam's
    local-step stage), with ratios to OneBitAdam at the default block size."""
    rows = [r for r in results if r["traffic"] and (r["kind"], r["block"]) in
            (("adamw", None), ("onebit_adam", lbcomm.config.DEFAULT_BLOCK_SIZE), ("zeroone", lbcomm.config.DEFAULT_BLOCK_SIZE))]
    if not rows:
        return

    def mean(r, i, lo):
        xs = [t[i] for t in r["traffic"][lo:]]
        return sum(xs) / max(1, len(xs))

    ref = next((r for r in rows if r["kind"] == "onebit_adam"), None)
    adamw = next((r for r in rows if r["kind"] == "adamw"), None)
    print(f"\ncommunication per step and rank, counted (whole run / steps {a.freeze + 1}..{a.steps}); "
          "rounds = collectives started")
    print(f"{'optimizer':<12}{'val/AdamW':>10}{'bytes (all)':>13}{'bytes (>frz)':>14}{'vs 1-bit Adam':>15}"
          f"{'rounds (all)':>14}{'rounds (>frz)':>15}")
    for r in rows:
        b_all, b_frz, r_all, r_frz = mean(r, 0, 0), mean(r, 0, a.freeze), mean(r, 1, 0), mean(r, 1, a.freeze)
        vs = f"{b_frz / mean(ref, 0, a.freeze):.3f}x" if ref and mean(ref, 0, a.freeze) else "-"
        ratio = f"{r['final'] / adamw['final']:.4f}" if adamw and math.isfinite(r["final"]) else "-"
        print(f"{LABEL[r['kind']]:<12}{ratio:>10}{b_all:>13,.0f}{b_frz:>14,.0f}{vs:>15}{r_all:>14.2f}{r_frz:>15.2f}")
        if r.get("steps_by_kind"):
            k = r["steps_by_kind"]
            print(f"{'':<12}steps: {k['variance_steps']} variance (fp32), {k['onebit_steps']} 1-bit, "
                  f"{k['local_steps']} local, {k['sync_steps']} syncs (var_update_scaler {a.var_update_scaler}, "
                  f"local_step_scaler {a.local_step_scaler}, local_step_clipper {a.local_step_clipper})")


def plot(results, a, path):
    plt = pyplot(path)
    if plt is None:
        return
    pairs = [(k, b) for k, b in BASELINE.items() if any(r["kind"] in (k, b) for r in results)]
    fig, axes = plt.subplots(1, len(pairs), figsize=(5.5 * len(pairs), 4.4), sharey=True, layout="constrained",
                             squeeze=False)
    axes = axes[0]
    for ax, (kind, base) in zip(axes, pairs):
        for r in results:
            if r["kind"] not in (kind, base) and not (kind == "onebit_adam" and r["kind"] == "zeroone"):
                continue
            xs, ys = zip(*r["curve"])
            full = r["kind"] == base
            label = LABEL[r["kind"]] + ("" if full or r["kind"] == "zeroone" else f" (block {r['block']})")
            ax.plot(xs, ys, label=label, lw=2.2 if full or r["block"] == lbcomm.config.DEFAULT_BLOCK_SIZE else 1.0,
                    ls="-" if full or r["block"] == lbcomm.config.DEFAULT_BLOCK_SIZE else "--", color="k" if full else None)
        ax.axvline(a.freeze, color="grey", ls=":", lw=1)
        ax.text(a.freeze, 0.98, " freeze", va="top", color="grey", fontsize=8, transform=ax.get_xaxis_transform())
        also = " and ZeroOneAdam" if kind == "onebit_adam" and any(r["kind"] == "zeroone" for r in results) else ""
        ax.set_title(f"{LABEL[kind]}{also} vs {LABEL[base]}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("validation loss (nats/byte)")
    finals = [r["final"] for r in results if math.isfinite(r["final"])] or [0.0]
    lo = min(finals)
    axes[0].set_ylim(lo - 0.1, lo + 1.6)
    fig.suptitle(f"byte-level LM on the Python stdlib, {a.ranks} gloo ranks, batch {a.batch}x{a.ctx} bytes")
    fig.savefig(path, dpi=110)
    print(f"\nloss curves written to {path}")
