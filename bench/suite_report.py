"""The convergence suite's tables (bench/suite.py): from the results of the runs to the
best-of-grid ratios, the same-lr ratios at every lr of the grid (also over several saved
runs, e.g. seeds), the targets they are held to, and the PNG of the ratios. Pure functions
of the result records (bench/suite_runs.py writes them), so `--report` needs no ranks.
"""
from __future__ import annotations

import math

from .plotting import pyplot
from .suite_runs import HOOKS, LABEL, TWIN


def is_diverged(r) -> bool:
    """Non-finite, or the run ended worse than the initial model."""
    return bool(r["diverged"]) or not math.isfinite(r["final"]) or r["final"] > r["init"]


def over_orders(results):
    """One record per (task, method, lr): the final loss is the mean over its batch orders
    (``--repeats``), non-finite if any order diverged."""
    groups = {}
    for r in results:
        groups.setdefault((r["task"], r["method"], r["lr"]), []).append(r)
    out = []
    for rs in groups.values():
        finals = [r["final"] for r in rs]
        ratios = [r["first_update_ratio"] for r in rs if r["first_update_ratio"] is not None]
        out.append({**rs[0], "final": sum(finals) / len(finals), "finals": finals,
                    "diverged": next((r["diverged"] for r in rs if r["diverged"]), None),
                    "first_update_ratio": max(ratios) if ratios else None})
    return out


def summarize(results):
    """{task: {method: (best final, lr, [lrs diverged while the twin did not])}}."""
    results = over_orders(results)
    out = {}
    for t in dict.fromkeys(r["task"] for r in results):
        out[t] = {}
        for m in dict.fromkeys(r["method"] for r in results):
            rs = [r for r in results if r["task"] == t and r["method"] == m]
            ok = [r for r in rs if not is_diverged(r)]
            best = min(ok, key=lambda r: r["final"]) if ok else None
            twin = {r["lr"]: is_diverged(r) for r in results if r["task"] == t and r["method"] == TWIN.get(m)}
            bad = [r["lr"] for r in rs if is_diverged(r) and m in TWIN and not twin.get(r["lr"], True)]
            first = max((r["first_update_ratio"] for r in rs if r["first_update_ratio"] is not None), default=None)
            out[t][m] = (best["final"] if best else float("inf"), best["lr"] if best else None, bad, first)
    return out


def same_lr(results):
    """{task: {method: {"cells": [[lr, ratio or None, mark], ...], "worst": ratio, "worst_lr": lr}}}
    for every 1-bit method whose twin ran: the ratio final / twin's final at the same lr, at
    every lr of the grid. mark "twin-div": the twin diverged at that lr (ratio None, not
    counted); "div": the 1-bit method diverged where the twin did not (ratio inf, counted)."""
    results = over_orders(results)
    by = {(r["task"], r["method"], r["lr"]): r for r in results}
    out = {}
    for t in dict.fromkeys(r["task"] for r in results):
        for m in dict.fromkeys(r["method"] for r in results):
            base = TWIN.get(m)
            lrs = [r["lr"] for r in results if r["task"] == t and r["method"] == m]
            if base is None or not any((t, base, lr) in by for lr in lrs):
                continue
            cells = []
            for lr in lrs:
                mine, twin = by[(t, m, lr)], by.get((t, base, lr))
                if twin is None:
                    continue
                if is_diverged(twin):
                    cells.append([lr, None, "twin-div"])
                elif is_diverged(mine):
                    cells.append([lr, math.inf, "div"])
                else:
                    cells.append([lr, mine["final"] / twin["final"], ""])
            counted = [c for c in cells if c[1] is not None]
            worst = max(counted, key=lambda c: c[1]) if counted else None
            out.setdefault(t, {})[m] = {"cells": cells, "worst": worst[1] if worst else None,
                                        "worst_lr": worst[0] if worst else None}
    return out


CONVERGED_LEFT = 0.2  # the twin "converged" at an lr: at most this share of its init-to-best drop left


def target_of(task: str) -> float:
    """The same-lr and best-of-grid target of a task: 1 % on the byte LM, 5 % elsewhere."""
    return 1.01 if task == "byte_lm" else 1.05


def twin_left(results):
    """{(task, method, lr): share of the method's drop from the initial loss to its best-of-grid
    loss still left at that lr} (0: the best lr of the grid; 1: no better than at init). The
    same-lr ratio is a lag where this is large: the loss is still falling steeply at the end,
    so a 1-bit run a few steps behind ends measurably higher."""
    best = summarize(results)  # best-of-grid final per task and method (inf: every lr diverged)
    out = {}
    for r in over_orders(results):
        b = best[r["task"]][r["method"]][0]
        if not is_diverged(r) and r["init"] > b:
            out[(r["task"], r["method"], r["lr"])] = (r["final"] - b) / (r["init"] - b)
    return out


def same_lr_over_runs(runs):
    """The same-lr cells of several saved runs (seeds) together: {task: {method: {"worst",
    "worst_lr", "worst_run", "cells", "over", "converged", "over_converged"}}}; "over": cells
    beyond the task's target; "converged"/"over_converged": the same among the cells where
    the twin has at most CONVERGED_LEFT of its drop left (`twin_left`)."""
    out = {}
    for k, results in enumerate(runs):
        left = twin_left(results)
        for t, row in same_lr(results).items():
            for m, cell_row in row.items():
                agg = out.setdefault(t, {}).setdefault(m, {"worst": None, "worst_lr": None, "worst_run": None,
                                                           "cells": 0, "over": 0, "converged": 0,
                                                           "over_converged": 0})
                for lr, ratio, _mark in cell_row["cells"]:
                    if ratio is None:
                        continue
                    over = not ratio <= target_of(t)
                    conv = left.get((t, TWIN[m], lr), math.inf) <= CONVERGED_LEFT
                    agg["cells"] += 1
                    agg["over"] += over
                    agg["converged"] += conv
                    agg["over_converged"] += over and conv
                    if agg["worst"] is None or ratio > agg["worst"]:
                        agg["worst"], agg["worst_lr"], agg["worst_run"] = ratio, lr, k
    return out


def report_over_runs(runs, paths, a):
    """The same-lr cells of several saved runs together (`same_lr_over_runs`), one table."""
    s = same_lr_over_runs(runs)
    tasks_ = list(s)
    pairs = [(m, b) for m, b in TWIN.items() if m in a.methods and b in a.methods]
    print(f"\n== same-lr ratio over {len(runs)} runs: " + ", ".join(paths))
    print(f"worst cell (run #, lr); cells over the target / cells; the same where the twin converged (at most "
          f"{CONVERGED_LEFT:g} of its init-to-best drop left)")

    def cell(m, t):
        g = s[t].get(m)
        if g is None or g["worst"] is None:
            return "-"
        return (f"{_worst_text(g['worst'])} (#{g['worst_run']} @{format(g['worst_lr'], 'g')}) "
                f"{g['over']}/{g['cells']}, {g['over_converged']}/{g['converged']}")

    _pair_table(pairs, tasks_, cell, 24, 33)
    return s


def _worst_text(w) -> str:
    return "D" if not math.isfinite(w) else f"{w:.3f}"


def _pair_table(pairs, tasks_, cell, label_w: int, col_w: int) -> None:
    """Print one row per (1-bit method, twin) pair and one column per task: cell(m, t)."""
    print(f"{'pair':<{label_w}}" + "".join(f"{t:>{col_w}}" for t in tasks_))
    for m, base in pairs:
        print(f"{LABEL[m] + ' / ' + LABEL[base]:<{label_w}}" + "".join(f"{cell(m, t):>{col_w}}" for t in tasks_))


def _ratio_cell(ratio, mark) -> str:
    if mark == "twin-div":
        return "t"
    if mark == "div":
        return "D"
    return f"{ratio:.3f}"


def report_same_lr(results, a):
    """The same-lr table: every lr of the grid, then the worst cell per task; returns the
    cells over target."""
    s = same_lr(results)
    tasks_ = list(s)
    misses = []
    pairs = [(m, b) for m, b in TWIN.items() if m in a.methods and b in a.methods]
    if not pairs or not tasks_:
        return misses
    print(f"\nsame-lr ratio 1-bit / twin at every lr of the grid (both twins at that lr; schedule "
          f"{getattr(a, 'schedule', 'cosine')}); t: the twin diverged there (not counted), "
          "D: the 1-bit method diverged where the twin did not")
    for m, base in pairs:
        print(f"  {LABEL[m]} / {LABEL[base]}")
        for t in tasks_:
            if m not in s[t]:
                continue
            row = s[t][m]
            cells = " ".join(f"{format(lr, 'g')}:{_ratio_cell(r, mark)}" for lr, r, mark in row["cells"])
            print(f"    {t:<14}{cells}")
    left = twin_left(results)
    print(f"  the twins' share of their init-to-best drop left at each lr (a large share: still far from "
          f"converged, where a lag shows most; <= {CONVERGED_LEFT:g} counts as converged)")
    for base in dict.fromkeys(b for _, b in pairs):
        for t in tasks_:
            cells = [(lr, left.get((t, base, lr))) for lr in sorted({r["lr"] for r in results
                                                                      if r["task"] == t and r["method"] == base})]
            print(f"    {LABEL[base]:<8}{t:<14}" + " ".join(
                f"{format(lr, 'g')}:{'-' if x is None else format(x, '.2f')}" for lr, x in cells))
    print("\nworst same-lr ratio per task (the lr of the worst cell)")

    def cell(m, t):
        row = s[t].get(m)
        return "-" if row is None or row["worst"] is None else \
            f"{_worst_text(row['worst'])} @{format(row['worst_lr'], 'g')}"

    _pair_table(pairs, tasks_, cell, 30, 22)
    for m, _ in pairs:
        for t in tasks_:
            row = s[t].get(m)
            w = None if row is None else row["worst"]
            if w is not None and not w <= target_of(t):
                misses.append(f"{LABEL[m]} on {t}: same-lr ratio "
                              + ("diverged" if not math.isfinite(w) else f"{w:.3f}")
                              + f" at lr {format(row['worst_lr'], 'g')} (target {target_of(t)})")
    return misses


def report(results, a):
    s = summarize(results)
    tasks_ = list(s)
    print(f"\nbest-of-grid final validation loss, {a.ranks} gloo ranks; ratio = 1-bit / its full-precision twin")
    print(f"{'pair':<30}" + "".join(f"{t:>16}" for t in tasks_))
    failures = []
    for m, base in TWIN.items():
        if m not in a.methods or base not in a.methods:
            continue
        cells = []
        for t in tasks_:
            mine, twin = s[t][m], s[t][base]
            ratio = mine[0] / twin[0]
            target = target_of(t)
            cell = f"{ratio:.3f}" if math.isfinite(ratio) else "all-div"
            if mine[2]:
                cell += f" d{len(mine[2])}"
            if not ratio <= target or mine[2]:
                failures.append(f"{LABEL[m]} on {t}: ratio {ratio:.3f} (target {target})"
                                + (f", diverged at lr {mine[2]} where {LABEL[base]} did not" if mine[2] else ""))
            cells.append(cell)
        print(f"{LABEL[m] + ' / ' + LABEL[base]:<30}" + "".join(f"{c:>16}" for c in cells))
    print("(dN: diverged at N lrs of the grid where the twin did not; diverged = non-finite or worse than at init)")
    print("\nlargest first compressed update of one coordinate over the grid, in units of the current lr")
    for m in ("onebit_adam", "onebit_lamb") + HOOKS:
        if m in a.methods:
            print(f"  {LABEL[m]:<16}" + "".join(
                f"{(format(s[t][m][3], '.3g') if s[t][m][3] is not None else '-'):>16}" for t in tasks_))
    hooks = [m for m in HOOKS + ("zeroone",) if m in a.methods]
    if hooks:
        print("\nbytes sent per rank / an fp32 ring allreduce's, whole run (start included), at the best lr")
        for m in hooks:
            cells = []
            for t in tasks_:
                r = [r for r in results if r["task"] == t and r["method"] == m and r["lr"] == s[t][m][1]]
                ok = r and r[0].get("bytes_sent") and r[0].get("bytes_uncompressed")
                cells.append(f"1/{r[0]['bytes_uncompressed'] / r[0]['bytes_sent']:.1f}" if ok else "-")
            print(f"  {LABEL[m]:<16}" + "".join(f"{c:>16}" for c in cells))
    print("\nbest lr per method: " + "; ".join(
        f"{t}: " + ", ".join(f"{LABEL[m]} {s[t][m][1]}" for m in a.methods) for t in tasks_))
    failures += report_same_lr(results, a)
    if failures:
        print("\nMISSED TARGETS:\n  " + "\n  ".join(failures))
    else:
        print("\nevery 1-bit method meets its targets on every task")
    return failures


def plot(results, a, path):
    plt = pyplot(path)
    if plt is None:
        return
    s = summarize(results)
    tasks_ = list(s)
    pairs = [(m, b) for m, b in TWIN.items() if m in a.methods and b in a.methods]
    fig, ax = plt.subplots(figsize=(9, 4), layout="constrained")
    w = 0.8 / max(1, len(pairs))
    for j, (m, b) in enumerate(pairs):
        ys = [min(s[t][m][0] / s[t][b][0], 3.0) for t in tasks_]
        ax.bar([i + j * w for i in range(len(tasks_))], ys, w, label=f"{LABEL[m]} / {LABEL[b]}")
    ax.axhline(1.05, color="grey", ls=":", lw=1)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + w * (len(pairs) - 1) / 2 for i in range(len(tasks_))], tasks_)
    ax.set_ylabel("best-of-grid val loss ratio (capped at 3)")
    ax.set_ylim(0.9, max(1.2, ax.get_ylim()[1]))
    ax.legend(fontsize=8)
    ax.set_title(f"1-bit / full precision, {a.ranks} gloo ranks" + (f", options {a.onebit_options}"
                                                                    if a.onebit_options else ""))
    fig.savefig(path, dpi=110)
    print(f"ratio plot written to {path}")
