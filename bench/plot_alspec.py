#!/usr/bin/env python3
"""Plots bench_alspec's N150 rows in the shape of the ALSpec paper's Figure 7.

Left: speedup of SP + TP4 (alspec on two 4-chip groups) over TP8 against context length, one
line per hit rate, measured through the actors (solid) and by Appendix F's formula (dashed).
Right: tokens/s of TP4 and TP8 alone.

    build/bench_alspec --csv build/alspec.csv
    python3 bench/plot_alspec.py build/alspec.csv build/alspec-fig7.png

Needs matplotlib (Debian: apt-get install python3-matplotlib).
"""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, out):
    rows = [r for r in csv.DictReader(open(src)) if r["table"] == "n150"]
    base = {(r["system"], int(r["context"])): r for r in rows if r["system"] in ("TP4", "TP8")}
    spec = defaultdict(list)
    for r in rows:
        if r["system"] == "SP+TP4":
            spec[round(float(r["hit_rate"]) * 100, 1)].append(r)

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (rate, rs) in enumerate(sorted(spec.items())):
        rs.sort(key=lambda r: int(r["context"]))
        ks = [int(r["context"]) // 1024 for r in rs]
        tp8 = [base[("TP8", int(r["context"]))] for r in rs]
        measured = [float(b["measured_s"]) / float(r["measured_s"]) for r, b in zip(rs, tp8)]
        formula = [float(b["formula_s"]) / float(r["formula_s"]) for r, b in zip(rs, tp8)]
        color = f"C{i}"
        left.plot(ks, measured, "o-", color=color, label=f"{rate:g} % hits")
        left.plot(ks, formula, "--", color=color, alpha=0.6)
    left.axhline(1.0, color="grey", lw=0.8)
    left.set_xlabel("context length (K tokens)")
    left.set_ylabel("speedup of SP + TP4 over TP8")
    left.set_title("SP + TP4 vs TP8 (solid: actors, dashed: formula)")
    left.legend()
    left.grid(alpha=0.3)

    for system, marker in (("TP4", "s"), ("TP8", "^")):
        rs = sorted((r for (s, _), r in base.items() if s == system), key=lambda r: int(r["context"]))
        ks = [int(r["context"]) // 1024 for r in rs]
        right.plot(ks, [float(r["measured_tok_s"]) for r in rs], marker + "-", label=f"{system} (actors)")
        right.plot(ks, [float(r["formula_tok_s"]) for r in rs], "--", color="grey", alpha=0.6)
    right.set_xlabel("context length (K tokens)")
    right.set_ylabel("tokens/s")
    right.set_title("Tensor parallel alone (dashed: formula)")
    right.legend()
    right.grid(alpha=0.3)

    fig.suptitle("Llama 3.1 8B on emulated Wormhole N150 chips, decode at batch 1")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: plot_alspec.py RESULTS.csv OUT.png")
    main(sys.argv[1], sys.argv[2])
