"""The paper's rule for comparing two configurations' scaling curves.

ScaleRL: asymptotes within +-0.02 are noise (three independent runs differed by at most
0.015). When two A's are that close, refit both with their average A and compare B, the
efficiency exponent: higher B reaches the shared ceiling with less compute. Otherwise the higher A
wins, however slowly it gets there. We also treat overlapping bootstrap intervals on A as "close",
so a pair of noisy short runs is not declared different on the strength of 0.021.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from analysis.curve import FitResult
from analysis.data import CurvesLike, as_curves
from analysis.intervals import BootstrapResult, Interval, Scheme, bootstrap_problem
from analysis.options import DEFAULT_OPTIONS, FitOptions
from analysis.problem import make_problem

Rule = Literal["asymptote", "efficiency", "undetermined"]
PAPER_MARGIN = 0.02


@dataclass(frozen=True)
class Comparison:
    """Verdict of the comparison rule between configurations labels[0] and labels[1].

    rule: "asymptote" (A's differ: the higher A wins), "efficiency" (A's close: the higher B under
        a shared A wins) or "undetermined" (a fit failed, or B's tie).
    winner: the winning label, or None. resolved: whether the lead is beyond noise (A intervals
        separate; for the efficiency rule, the shared-A B intervals separate; False if unknown).
    A, A_interval: each side's own fit. shared_A, B, B_interval, Cmid: the shared-A refits
        (None under the asymptote rule). delta_A = A[0] - A[1].
    """

    labels: tuple[str, str]
    rule: Rule
    winner: str | None
    resolved: bool
    reason: str
    margin: float
    A: tuple[float, float]
    A_interval: tuple[Interval, Interval]
    delta_A: float
    shared_A: float | None = None
    B: tuple[float, float] | None = None
    B_interval: tuple[Interval, Interval] | None = None
    Cmid: tuple[float, float] | None = None
    fits: tuple[BootstrapResult, BootstrapResult] | None = field(default=None, repr=False, compare=False)
    shared_fits: tuple[BootstrapResult, BootstrapResult] | None = field(default=None, repr=False, compare=False)


def compare(
    data_a: CurvesLike,
    data_b: CurvesLike,
    *,
    margin: float = PAPER_MARGIN,
    labels: tuple[str, str] = ("a", "b"),
    n_boot: int = 200,
    seed: int = 0,
    level: float = 0.95,
    scheme: Scheme = "noise_model",
    options: FitOptions = DEFAULT_OPTIONS,
) -> Comparison:
    """Compare two configurations by the paper's rule (module docstring).

    data_a, data_b: a (compute, pass_rate) pair, or a list of them (seeds, fitted jointly).
    n_boot = 0 skips the intervals: then only the margin decides, and an efficiency verdict is
    never "resolved".
    """
    if not (math.isfinite(margin) and margin >= 0):
        raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
    if len(labels) != 2 or labels[0] == labels[1]:
        raise ValueError(f"labels must be two distinct names, got {labels!r}")
    curves = (as_curves(data_a), as_curves(data_b))

    def fit_both(opts: FitOptions) -> tuple[BootstrapResult, BootstrapResult]:
        a, b = (
            bootstrap_problem(make_problem(c, opts), opts, n_boot=n_boot, seed=seed, level=level, scheme=scheme)
            for c in curves
        )
        return a, b

    own = fit_both(options)
    fa, fb = own[0].fit, own[1].fit
    if not (fa.ok and fb.ok):
        return _verdict(labels, margin, own, "undetermined", None, False, _failed_reason(labels, fa, fb))
    delta = fa.A - fb.A
    if abs(delta) > margin and not own[0].A.overlaps(own[1].A):
        winner = labels[0] if delta > 0 else labels[1]
        reason = (
            f"A differs beyond the margin: {fa.A:.3f} vs {fb.A:.3f} (|dA| = {abs(delta):.3f} > {margin}); "
            f"{winner} has the higher asymptote"
        )
        return _verdict(labels, margin, own, "asymptote", winner, True, reason)
    shared = (fa.A + fb.A) / 2.0
    refits = fit_both(options.replace(fix_a=shared))
    close = f"A close ({fa.A:.3f} vs {fb.A:.3f}: within {margin} or intervals overlapping)"
    ra, rb = refits[0].fit, refits[1].fit
    if not (ra.ok and rb.ok):
        reason = f"{close}; shared-A refit failed: {_failed_reason(labels, ra, rb)}"
        return _verdict(labels, margin, own, "undetermined", None, False, reason, shared, refits)
    if ra.B == rb.B:
        reason = f"{close}; with shared A = {shared:.3f}, B ties at {ra.B:.3f}"
        return _verdict(labels, margin, own, "undetermined", None, False, reason, shared, refits)
    winner = labels[0] if ra.B > rb.B else labels[1]
    resolved = refits[0].B.known and refits[1].B.known and not refits[0].B.overlaps(refits[1].B)
    reason = f"{close}; with shared A = {shared:.3f}, B = {ra.B:.3f} vs {rb.B:.3f}: {winner} is more efficient" + (
        "" if resolved else " (B intervals overlap)"
    )
    return _verdict(labels, margin, own, "efficiency", winner, resolved, reason, shared, refits)


def _verdict(
    labels: tuple[str, str],
    margin: float,
    own: tuple[BootstrapResult, BootstrapResult],
    rule: Rule,
    winner: str | None,
    resolved: bool,
    reason: str,
    shared: float | None = None,
    refits: tuple[BootstrapResult, BootstrapResult] | None = None,
) -> Comparison:
    fa, fb = own[0].fit, own[1].fit
    return Comparison(
        labels=(labels[0], labels[1]),
        rule=rule,
        winner=winner,
        resolved=resolved,
        reason=reason,
        margin=margin,
        A=(fa.A, fb.A),
        A_interval=(own[0].A, own[1].A),
        delta_A=fa.A - fb.A,
        shared_A=shared,
        B=None if refits is None else (refits[0].fit.B, refits[1].fit.B),
        B_interval=None if refits is None else (refits[0].B, refits[1].B),
        Cmid=None if refits is None else (refits[0].fit.Cmid, refits[1].fit.Cmid),
        fits=own,
        shared_fits=refits,
    )


def _failed_reason(labels: tuple[str, str], fa: FitResult, fb: FitResult) -> str:
    bad = [f"{label}: {', '.join(f.flags) or 'no fit'}" for label, f in zip(labels, (fa, fb), strict=True) if not f.ok]
    return "fit failed (" + "; ".join(bad) + ")"
