"""Ranking, comparisons and axis effects over fitted configurations: the pure part of the report.

A configuration is a run's axis values without its seed; its seeds' curves are fitted jointly.
Ranking (the paper's question, "which choice raises the ceiling"): by A, then B, among the
configurations whose fit carries no flag. Adjacent ranked configurations are compared with the
paper's rule: A's within the margin (or with overlapping intervals) are refitted with a shared A
and compared on B. Each axis gets a verdict: does it move A, or only B and Cmid? (docs/analysis.md)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from analysis.comparison import Comparison, compare
from analysis.curve import FitResult
from analysis.effects import DEFAULT_EFFECT_OPTIONS, AxisEffect, EffectOptions, axis_effect, matched_axis_effect
from analysis.extrapolation import Extrapolation
from analysis.intervals import BootstrapResult
from analysis.options import FitOptions

MAX_COMPARISONS = 20
ABLATE_AXIS = "ablate"
"""The axis a sweep's `ablate:` block adds: `base`, or the name of the change (launcher.grid)."""


@dataclass(frozen=True)
class Curve:
    run: str
    seed: int | None
    state: str
    compute: tuple[float, ...]
    pass_rate: tuple[float, ...]


@dataclass(frozen=True)
class ConfigResult:
    label: str
    axes: dict[str, Any]
    curves: tuple[Curve, ...]
    fit: FitResult
    boot: BootstrapResult | None = None
    extrapolation: Extrapolation | None = None
    rank: int | None = None
    rank_at_predict: int | None = None
    """Rank by the predicted pass rate at `--predict` (1 = highest), among configurations with a prediction."""
    p_best: float | None = None
    """The bootstrap's probability that this configuration is the best at `--predict`."""

    @property
    def runs(self) -> list[str]:
        return [c.run for c in self.curves]

    @property
    def seeds(self) -> list[int | None]:
        return [c.seed for c in self.curves]

    def curve_data(self) -> list[tuple[tuple[float, ...], tuple[float, ...]]]:
        return [(c.compute, c.pass_rate) for c in self.curves]


def rank(configs: Sequence[ConfigResult], *, include_flagged: bool = False) -> list[ConfigResult]:
    """Ranked configurations first (by A, then B, higher first), then the unranked ones."""
    eligible = [c for c in configs if c.fit.ok and (include_flagged or not c.fit.flags)]
    ranked = sorted(eligible, key=lambda c: (-c.fit.A, -c.fit.B))
    chosen = {id(c) for c in eligible}  # by identity: comparing dataclasses made this quadratic
    rest = [replace(c, rank=None) for c in configs if id(c) not in chosen]
    return [replace(c, rank=i + 1) for i, c in enumerate(ranked)] + rest


def rank_at_predict(configs: Sequence[ConfigResult]) -> list[ConfigResult]:
    """The paper's use of the fits: order by the pass rate predicted at C, and give each
    configuration the probability that it is the best at C (`p_best`).

    p_best: replicate j of every configuration's bootstrap is one joint draw (replicates are
    independent across configurations); the share of draws in which a configuration predicts the
    highest pass rate. Configurations without a prediction get neither.
    """
    predicted = [c for c in configs if c.extrapolation is not None and math.isfinite(c.extrapolation.predicted)]
    order = sorted(predicted, key=lambda c: -c.extrapolation.predicted)  # type: ignore[union-attr]
    ranks = {c.label: i + 1 for i, c in enumerate(order)}
    probabilities = p_best([c.extrapolation.bootstrap.draws(c.extrapolation.predict_at) for c in predicted])  # type: ignore[union-attr]
    best = {c.label: p for c, p in zip(predicted, probabilities)}
    return [replace(c, rank_at_predict=ranks.get(c.label), p_best=best.get(c.label)) for c in configs]


def p_best(draws: Sequence[np.ndarray]) -> list[float | None]:
    """For each configuration's draws of one quantity, the share of joint draws (replicate j of
    each) in which it is the largest; ties split evenly. None for a configuration without draws."""
    usable = [i for i, d in enumerate(draws) if len(d)]
    out: list[float | None] = [None] * len(draws)
    if not usable:
        return out
    n = min(len(draws[i]) for i in usable)
    matrix = np.stack([np.asarray(draws[i][:n], dtype=float) for i in usable], axis=1)
    winners = matrix == matrix.max(axis=1, keepdims=True)
    shares = (winners / winners.sum(axis=1, keepdims=True)).mean(axis=0)
    for i, share in zip(usable, shares):
        out[i] = float(share)
    return out


def comparisons(
    configs: Sequence[ConfigResult], *, margin: float, n_boot: int, level: float, options: FitOptions
) -> list[Comparison]:
    """The paper's rule on neighbours in the ranking (at most `MAX_COMPARISONS` pairs)."""
    ranked = [c for c in configs if c.rank is not None][: MAX_COMPARISONS + 1]
    out = []
    for a, b in zip(ranked, ranked[1:]):
        out.append(
            compare(
                a.curve_data(),
                b.curve_data(),
                margin=margin,
                labels=(a.label, b.label),
                n_boot=max(n_boot, 50),
                level=level,
                options=options,
            )  # fmt: skip
        )
    return out


def effects(configs: Sequence[ConfigResult], options: EffectOptions = DEFAULT_EFFECT_OPTIONS) -> list[AxisEffect]:
    """For each axis: does it move the asymptote or only the efficiency?

    An axis is judged on configurations that differ in it alone (the other axes held fixed,
    `matched_axis_effect`); where no two configurations do, on all of them pooled by its value.
    The `ablate` axis of a leave-one-out sweep names which other axis changed, so it is not held
    fixed (it would keep every ablation apart from the base), and is itself judged pooled, against
    `base`.
    """
    usable = [c for c in configs if c.fit.ok]
    keys: list[str] = []
    for c in usable:
        keys += [k for k in c.axes if k not in keys]
    effects = []
    for key in keys:
        groups: dict[str, list[Any]] = {}
        contexts: dict[tuple[str, ...], dict[str, list[Any]]] = {}
        for c in usable:
            value = fmt_axis_value(c.axes.get(key))
            groups.setdefault(value, []).append(c.boot or c.fit)
            others = tuple(fmt_axis_value(c.axes.get(k)) for k in keys if k not in (key, ABLATE_AXIS))
            contexts.setdefault(others, {}).setdefault(value, []).append(c.boot or c.fit)
        if len(groups) < 2:
            continue
        reference = "base" if key == ABLATE_AXIS and "base" in groups else None
        matched = [c for c in contexts.values() if len(c) >= 2] if key != ABLATE_AXIS else []
        if matched:
            effect = matched_axis_effect(matched, options, axis=key, reference=reference)
        else:
            effect = axis_effect(groups, options, axis=key, reference=reference)
        effects.append(effect)
    return effects



# ---------------------------------------------------------------------------------------------
# Labels


def config_label(axes: dict[str, Any]) -> str:
    return ", ".join(f"{k}={fmt_axis_value(v)}" for k, v in axes.items())


def fmt_axis_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
