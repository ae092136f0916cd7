"""Effects of one sweep axis: does it move the asymptote, or only the efficiency?

The paper's central reading of an ablation: loss type, FP32 head, batch size, generation
length and model size move A; most other choices only move B and Cmid. This module reduces the fits
of each value of an axis to that verdict, with effect sizes against a reference value.

Input: {axis value: fits}, where fits is one FitResult/BootstrapResult or a list of them (seeds of
that value, each fitted separately). For efficiency verdicts in the paper's sense, pass fits made
with a shared A (compare.compare does that for two configurations): with free A, B and Cmid trade
off against A and differences in them partly mirror differences in A.

In a grid of several axes, `matched_axis_effect` judges an axis the way the paper does, holding
the other axes fixed: configurations that differ in this axis only are compared with each other
(one `axis_effect` per setting of the other axes), never pooled across another axis that moves A
itself. Pooling would mix the other axis's effect into each value's spread: in a 2 x 2 grid of
generation budget x learning rate, the learning-rate groups each hold one short-budget and one
long-budget run, their A intervals span both ceilings, and no axis could ever separate.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from analysis.comparison import PAPER_MARGIN
from analysis.curve import FitResult
from analysis.intervals import UNKNOWN, BootstrapResult, Interval

FitLike = FitResult | BootstrapResult
Verdict = Literal["asymptote", "efficiency", "neither"]


@dataclass(frozen=True, kw_only=True)
class EffectOptions:
    """How an axis is judged: `margin` on A (the paper's 0.02), relative tolerances on B (5%) and
    Cmid (25%) below which a difference is not an effect, and the level of the intervals."""

    margin: float = PAPER_MARGIN
    b_tol: float = 0.05
    cmid_tol: float = 0.25
    level: float = 0.95

    def __post_init__(self) -> None:
        for name in ("margin", "b_tol", "cmid_tol"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        if not 0 < self.level < 1:
            raise ValueError(f"level must lie in (0, 1), got {self.level!r}")


DEFAULT_EFFECT_OPTIONS = EffectOptions()


@dataclass(frozen=True)
class GroupSummary:
    """One axis value: mean A and B, geometric-mean Cmid over its usable fits, their intervals, and
    effects against the reference value (delta_A = A - A_ref, B_ratio = B / B_ref, Cmid_ratio).

    Intervals: with one fit, its bootstrap intervals (unknown for a bare FitResult); with several
    (seeds), a t-interval of the mean from their spread (Cmid on a log scale).
    """

    value: str
    n_fits: int
    A: float
    B: float
    Cmid: float
    A_interval: Interval
    B_interval: Interval
    Cmid_interval: Interval
    delta_A: float
    B_ratio: float
    Cmid_ratio: float


@dataclass(frozen=True)
class AxisEffect:
    """Verdict for one axis: "asymptote" when some pair of values differs in A by more than the
    margin with non-overlapping intervals; else "efficiency" when some pair differs in B by more
    than b_tol (relative) or in Cmid by more than cmid_tol (relative), again with non-overlapping
    intervals; else "neither". Unknown intervals count as non-overlapping (the tolerance decides).
    max_delta_A, max_B_ratio, max_Cmid_ratio: the largest pairwise differences (ratios >= 1)."""

    axis: str
    reference: str
    groups: tuple[GroupSummary, ...]
    verdict: Verdict
    moves_asymptote: bool
    moves_efficiency: bool
    max_delta_A: float
    max_B_ratio: float
    max_Cmid_ratio: float

    def group(self, value: str) -> GroupSummary:
        for g in self.groups:
            if g.value == value:
                return g
        raise ValueError(f"value must be one of {[g.value for g in self.groups]}, got {value!r}")


def axis_effect(
    groups: Mapping[str, FitLike | Sequence[FitLike]],
    options: EffectOptions = DEFAULT_EFFECT_OPTIONS,
    *,
    axis: str = "",
    reference: str | None = None,
) -> AxisEffect:
    """Summarise an axis (see AxisEffect). `reference`: the value effects are measured against;
    default: the first key (e.g. the base recipe's value)."""
    if len(groups) < 2:
        raise ValueError(f"groups must hold at least two axis values, got {list(groups)!r}")
    ref = next(iter(groups)) if reference is None else reference
    if ref not in groups:
        raise ValueError(f"reference must be one of {list(groups)!r}, got {reference!r}")
    margin, b_tol, cmid_tol = options.margin, options.b_tol, options.cmid_tol
    raw = {str(k): _summarise(str(k), _as_list(v), options.level) for k, v in groups.items()}
    base = raw[str(ref)]
    summaries = tuple(_relative(g, base) for g in raw.values())
    pairs = list(itertools.combinations([g for g in summaries if math.isfinite(g.A)], 2))
    moves_a = any(_differs(g.A - h.A, margin, g.A_interval, h.A_interval) for g, h in pairs)
    moves_b = any(_differs(math.log(g.B / h.B), math.log1p(b_tol), g.B_interval, h.B_interval) for g, h in pairs)
    moves_c = any(
        _differs(math.log(g.Cmid / h.Cmid), math.log1p(cmid_tol), g.Cmid_interval, h.Cmid_interval) for g, h in pairs
    )
    verdict: Verdict = "asymptote" if moves_a else "efficiency" if (moves_b or moves_c) else "neither"
    return AxisEffect(
        axis=axis,
        reference=str(ref),
        groups=summaries,
        verdict=verdict,
        moves_asymptote=moves_a,
        moves_efficiency=moves_b or moves_c,
        max_delta_A=max((abs(g.A - h.A) for g, h in pairs), default=math.nan),
        max_B_ratio=max((max(g.B / h.B, h.B / g.B) for g, h in pairs), default=math.nan),
        max_Cmid_ratio=max((max(g.Cmid / h.Cmid, h.Cmid / g.Cmid) for g, h in pairs), default=math.nan),
    )


def matched_axis_effect(
    contexts: Sequence[Mapping[str, FitLike | Sequence[FitLike]]],
    options: EffectOptions = DEFAULT_EFFECT_OPTIONS,
    *,
    axis: str = "",
    reference: str | None = None,
) -> AxisEffect:
    """An axis's effect with the other axes held fixed.

    `contexts`: one {axis value: fits} per setting of the other axes, each with at least two
    values. Each context is judged by `axis_effect`; the axis moves A (or only the efficiency)
    when it does so in some context, and the maxima are taken over contexts. `groups` summarise
    each value over all contexts together (for display: with other axes that move A, their A
    spread is wide); `reference` defaults to the first value of the first context.
    """
    usable = [c for c in contexts if len(c) >= 2]
    if not usable:
        raise ValueError("contexts must hold at least one context with two or more axis values")
    ref = str(next(iter(usable[0]))) if reference is None else str(reference)
    pooled: dict[str, list[FitLike]] = {}
    for context in usable:
        for value, fits in context.items():
            pooled.setdefault(str(value), []).extend(_as_list(fits))
    if ref not in pooled:
        raise ValueError(f"reference must be one of {list(pooled)!r}, got {reference!r}")
    effects = [axis_effect(c, options, axis=axis, reference=ref if ref in map(str, c) else None) for c in usable]
    overall = axis_effect(pooled, options, axis=axis, reference=ref)
    moves_a = any(e.moves_asymptote for e in effects)
    moves_eff = any(e.moves_efficiency for e in effects)
    verdict: Verdict = "asymptote" if moves_a else "efficiency" if moves_eff else "neither"
    return AxisEffect(
        axis=axis,
        reference=ref,
        groups=overall.groups,
        verdict=verdict,
        moves_asymptote=moves_a,
        moves_efficiency=moves_eff,
        max_delta_A=_nanmax(e.max_delta_A for e in effects),
        max_B_ratio=_nanmax(e.max_B_ratio for e in effects),
        max_Cmid_ratio=_nanmax(e.max_Cmid_ratio for e in effects),
    )


def _nanmax(values: Iterable[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else math.nan


def _as_list(value: FitLike | Sequence[FitLike]) -> list[FitLike]:
    if isinstance(value, (FitResult, BootstrapResult)):
        return [value]
    items = list(value)
    for item in items:
        if not isinstance(item, (FitResult, BootstrapResult)):
            raise ValueError(f"groups values must be FitResult/BootstrapResult or lists of them, got {item!r:.80}")
    return items


def _summarise(value: str, items: list[FitLike], level: float) -> GroupSummary:
    usable = [i for i in items if (i.fit if isinstance(i, BootstrapResult) else i).ok]
    fits = [i.fit if isinstance(i, BootstrapResult) else i for i in usable]
    nan = math.nan
    if not fits:
        return GroupSummary(value, 0, nan, nan, nan, UNKNOWN, UNKNOWN, UNKNOWN, nan, nan, nan)
    a = np.array([f.A for f in fits])
    b = np.array([f.B for f in fits])
    log_c = np.log([f.Cmid for f in fits])
    if len(usable) == 1 and isinstance(usable[0], BootstrapResult):
        boot = usable[0]
        intervals = (boot.A, boot.B, boot.Cmid)
    elif len(fits) >= 2:
        intervals = (_t_interval(a, level), _t_interval(b, level), _exp(_t_interval(log_c, level)))
    else:
        intervals = (UNKNOWN, UNKNOWN, UNKNOWN)
    return GroupSummary(
        value, len(fits), float(a.mean()), float(b.mean()), float(np.exp(log_c.mean())), *intervals, nan, nan, nan
    )


def _relative(g: GroupSummary, base: GroupSummary) -> GroupSummary:
    return GroupSummary(
        g.value,
        g.n_fits,
        g.A,
        g.B,
        g.Cmid,
        g.A_interval,
        g.B_interval,
        g.Cmid_interval,
        delta_A=g.A - base.A,
        B_ratio=g.B / base.B,
        Cmid_ratio=g.Cmid / base.Cmid,
    )


def _differs(delta: float, tol: float, first: Interval, second: Interval) -> bool:
    """Beyond the tolerance, and (where both intervals are known) with separate intervals."""
    return abs(delta) > tol and not first.overlaps(second)


def _t_interval(x: np.ndarray, level: float) -> Interval:
    from scipy import stats  # lazy: ~0.5 s import

    half = stats.t.ppf(0.5 + level / 2, df=x.size - 1) * x.std(ddof=1) / math.sqrt(x.size)
    return Interval(float(x.mean() - half), float(x.mean() + half))


def _exp(interval: Interval) -> Interval:
    return Interval(math.exp(interval.lo), math.exp(interval.hi))
