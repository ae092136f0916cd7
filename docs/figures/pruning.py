"""Draw docs/figures/pruning.png: the pruning example replayed by both pruners.

    python docs/figures/pruning.py

The curves are analysis.synthetic.late_winner_sweep(0) (the sweep of tests/test_prune.py, mean
of its two seeds per configuration); each configuration's line ends where a pruner stopped it.
Left: the asymptote pruner (fitted ceilings, the default policy); right: a current-value pruner.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from analysis.pruning import PrunePolicy, simulate, simulate_current
from analysis.synthetic import LATE_WINNER, late_winner_sweep

OUT = Path(__file__).with_suffix(".png")


def main() -> None:
    curves = late_winner_sweep(0)
    policy = PrunePolicy()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, sim in zip(axes, (simulate(curves, policy), simulate_current(curves, policy)), strict=True):
        verdicts = {v.label: v for v in sim.verdicts}
        for i, (label, seeds) in enumerate(curves.items()):
            c = seeds[0][0]
            r = np.mean([s[1] for s in seeds], axis=0)
            color = f"C{i}"
            stop = verdicts[label].pruned_at
            kept = c <= stop if stop is not None else np.ones_like(c, dtype=bool)
            ax.plot(c[kept], r[kept], color=color, lw=1.6, label=f"{label} (A {LATE_WINNER[label][0]:.2f})")
            ax.plot(c[~kept], r[~kept], color=color, lw=0.8, alpha=0.25)
            if stop is not None:
                ax.plot([stop], [r[kept][-1]], "x", color=color, ms=9, mew=2)
        ax.set_title(f"{sim.pruner} pruner: saves {sim.saved_fraction:.0%}, best "
                     f"{'kept' if sim.best_survived else 'pruned'}")  # fmt: skip
        ax.set_xlabel("compute")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("pass rate (mean of 2 seeds)")
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle("Pruning a sweep whose best configuration starts slowest (x: pruned; faint: the compute saved)")
    fig.tight_layout()
    fig.savefig(OUT, dpi=110)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
