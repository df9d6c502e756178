#!/usr/bin/env python3
"""Plots bench_strategies' table: tokens/s and time to first token per strategy and pair.

With rows at several --stages (runs appended to one CSV), a third panel shows each
strategy's speedup over `ar` against the number of target stages.

    build/bench_strategies --tree 1,1,3,1 --n-parallel 3 --p-split 0.2 --csv build/strategies.csv
    python3 bench/plot_strategies.py build/strategies.csv build/strategies.png

Needs matplotlib (Debian: apt-get install python3-matplotlib).
"""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, out):
    rows = list(csv.DictReader(open(src)))
    if not rows:
        sys.exit(f"{src}: no rows")
    stages = sorted({int(r["stages"]) for r in rows})
    # The bar panels show the most common stage count (the default run).
    base = max(stages, key=lambda n: sum(int(r["stages"]) == n for r in rows))
    at_base = [r for r in rows if int(r["stages"]) == base]
    pairs = list(dict.fromkeys(f'{r["target"]}\n{r["draft"]}' for r in at_base))
    strategies = list(dict.fromkeys(r["strategy"] for r in at_base))
    value = {(f'{r["target"]}\n{r["draft"]}', r["strategy"]): r for r in at_base}

    panels = 3 if len(stages) > 1 else 2
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.6))
    width = 0.8 / len(strategies)
    for ax, key, label in ((axes[0], "tokens_per_s", "tokens/s (after the first)"),
                           (axes[1], "ttft_ms", "time to first token (ms)")):
        for i, s in enumerate(strategies):
            xs = [p + (i - (len(strategies) - 1) / 2) * width for p in range(len(pairs))]
            ys = [float(value[(p, s)][key]) if (p, s) in value else 0 for p in pairs]
            ax.bar(xs, ys, width, label=s, color=f"C{i}")
        ax.set_xticks(range(len(pairs)), pairs, fontsize=7)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    # Below the panels, one row per few strategies: inside, it would hide the bars.
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=min(len(strategies), 5), fontsize=8)
    legend_rows = (len(strategies) + 4) // 5
    axes[0].set_title(f"{base} target stages, emulated devices")

    if panels == 3:
        ax = axes[2]
        ar = {(r["target"], r["draft"], int(r["stages"])): float(r["tokens_per_s"]) for r in rows if r["strategy"] == "ar"}
        speedup = defaultdict(lambda: defaultdict(list))
        for r in rows:
            k = (r["target"], r["draft"], int(r["stages"]))
            if r["strategy"] != "ar" and k in ar:
                speedup[r["strategy"]][k[2]].append(float(r["tokens_per_s"]) / ar[k])
        for i, (s, by_n) in enumerate(sorted(speedup.items(), key=lambda kv: strategies.index(kv[0]) if kv[0] in strategies else 99)):
            ns = sorted(by_n)
            ax.plot(ns, [sum(by_n[n]) / len(by_n[n]) for n in ns], "o-", label=s, color=f"C{strategies.index(s) if s in strategies else i}")
        ax.set_xlabel("target stages")
        ax.set_ylabel("tokens/s over ar (mean over pairs)")
        ax.set_xticks(stages)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.02 + 0.045 * legend_rows, 1, 1))
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: plot_strategies.py TABLE.csv OUT.png")
    main(sys.argv[1], sys.argv[2])
