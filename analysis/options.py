"""Every knob of a curve fit, validated once, in one frozen dataclass.

`fit`, `bootstrap`, `compare` and `extrapolate` each take one `FitOptions`, so a report fits
every curve the same way and no function re-declares these knobs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Literal

import numpy as np

R0Mode = Literal["first", "fit"] | float
Method = Literal["fast", "reference"]

A_GRID_STEP = 0.005
PAPER_A_GRID: tuple[float, ...] = tuple(round(0.45 + A_GRID_STEP * i, 3) for i in range(71))  # 0.450..0.800
PAPER_CMID_SPAN = (1 / 160, 2.5)  # paper: Cmid in [100, 40000] GPU-hours for 16k-GPU-hour runs
METHODS = ("fast", "reference")


@dataclass(frozen=True, kw_only=True)
class FitOptions:
    """How to fit R(C) = R0 + (A - R0) / (1 + (Cmid/C)^B).

    r0: "first" (default) = the measured pass rate at the lowest compute (mean over ties), taken
        from all points including those before the cutoff: the paper fits after a warm-up window
        but R0 is the start of the run, and the first eval is usually at step 0 (C = 0), where the
        curve equals R0 exactly. If the first eval is at C1 > 0 the curve there is
        R0 + (A - R0) g(C1) with g(C1) = 1/(1 + (Cmid/C1)^B), well under 1% for C1 << Cmid, so the
        bias is negligible. A fixed R0 keeps B and Cmid identifiable on short runs.
        "fit": R0 is a fourth free parameter in [0, 1]. A float: R0 held at that value.
    cutoff: points with compute < cutoff are left out of the fit (paper: ~1.5k of 16k GPU-hours).
    method: "fast" (bounded direct least squares, falls back to the grid) or "reference" (the
        paper's grid search).
    a_bounds: range of A for both methods; the reference grid is cut to it.
    a_grid: reference A grid; None = the paper's 0.450..0.800 step 0.005.
    widen_a_grid: widen the A grid (same step) when the data leave it: up to a_bounds[1] when the
        fitted window's max pass rate exceeds the grid's top (the asymptote cannot be below what
        was measured, e.g. a CPU toy task that climbs to 0.98), and down to just below the
        window's min pass rate when even its max is below the grid's bottom (a weak model).
    cmid_range: (lo, hi) of the reference's 100 linear Cmid values; None = the paper's range
        scaled to the data: (Cmax / 160, 2.5 Cmax) with Cmax the window's max compute, which is
        exactly [100, 40000] for a 16k-GPU-hour run.
    num_cmid: number of Cmid grid values (paper: 100).
    b_bounds: B range of the fast method, up to a near step (B > ~10 means the gain happens
        between two evals: noisy flat runs can fit that way, and so can the reference). The
        reference fits B unbounded (B <= 0 discarded), so a fast fit that ends on a B bound falls
        back to the reference.
    cmid_bounds: Cmid range of the fast method; None = (cmid_range lo / 10, cmid_range hi * 4),
        which contains the reference grid, so the fast method can always match the reference.
    fix_a: hold A at this value (shared-A refits of the comparison rule).
    min_points: fewer points after the cutoff give a NaN result flagged "too_few_points".
    bound_tol: |A - bound| <= bound_tol flags "A_at_bound".
    collapse_frac, collapse_k, collapse_min_drop: see diagnostics.is_collapsing.
    """

    r0: R0Mode = "first"
    cutoff: float = 0.0
    method: Method = "fast"
    a_bounds: tuple[float, float] = (0.0, 1.0)
    a_grid: tuple[float, ...] | None = None
    widen_a_grid: bool = True
    cmid_range: tuple[float, float] | None = None
    num_cmid: int = 100
    b_bounds: tuple[float, float] = (0.01, 1000.0)
    cmid_bounds: tuple[float, float] | None = None
    fix_a: float | None = None
    min_points: int = 5
    bound_tol: float = 1e-3
    collapse_frac: float = 0.2
    collapse_k: float = 3.0
    collapse_min_drop: float = 0.01

    def __post_init__(self) -> None:
        self._check_r0()
        if not (math.isfinite(self.cutoff) and self.cutoff >= 0):
            raise ValueError(f"cutoff must be a finite number >= 0, got {self.cutoff!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        lo, hi = _pair("a_bounds", self.a_bounds)
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"a_bounds must satisfy 0 <= lo < hi <= 1, got {self.a_bounds!r}")
        if self.a_grid is not None:
            grid = tuple(float(a) for a in self.a_grid)
            if not grid or not all(0.0 <= a <= 1.0 for a in grid):
                raise ValueError(f"a_grid must be non-empty values in [0, 1], got {self.a_grid!r}")
            object.__setattr__(self, "a_grid", tuple(sorted(set(grid))))
        for name in ("cmid_range", "cmid_bounds"):
            value = getattr(self, name)
            if value is not None:
                a, b = _pair(name, value)
                if not 0 < a < b < math.inf:
                    raise ValueError(f"{name} must satisfy 0 < lo < hi < inf, got {value!r}")
        b_lo, b_hi = _pair("b_bounds", self.b_bounds)
        if not 0 < b_lo < b_hi < math.inf:
            raise ValueError(f"b_bounds must satisfy 0 < lo < hi < inf, got {self.b_bounds!r}")
        if self.num_cmid < 1:
            raise ValueError(f"num_cmid must be >= 1, got {self.num_cmid!r}")
        if self.fix_a is not None and not 0.0 <= self.fix_a <= 1.0:
            raise ValueError(f"fix_a must lie in [0, 1], got {self.fix_a!r}")
        if self.min_points < 1:
            raise ValueError(f"min_points must be >= 1, got {self.min_points!r}")
        if not self.bound_tol >= 0:
            raise ValueError(f"bound_tol must be >= 0, got {self.bound_tol!r}")
        if not 0 < self.collapse_frac < 1:
            raise ValueError(f"collapse_frac must lie in (0, 1), got {self.collapse_frac!r}")
        if not (self.collapse_k >= 0 and self.collapse_min_drop >= 0):
            raise ValueError(
                f"collapse_k and collapse_min_drop must be >= 0, got {self.collapse_k!r}, {self.collapse_min_drop!r}"
            )

    def _check_r0(self) -> None:
        if isinstance(self.r0, str):
            if self.r0 not in ("first", "fit"):
                raise ValueError(f"r0 must be 'first', 'fit' or a float in [0, 1], got {self.r0!r}")
        elif not (isinstance(self.r0, (int, float)) and 0.0 <= float(self.r0) <= 1.0):
            raise ValueError(f"r0 must be 'first', 'fit' or a float in [0, 1], got {self.r0!r}")

    def replace(self, **changes: object) -> FitOptions:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    @property
    def fits_r0(self) -> bool:
        return self.r0 == "fit"


def resolve_a_grid(options: FitOptions, window_pass_rate: np.ndarray) -> np.ndarray:
    """The reference A grid actually searched: given or paper's, widened to the data, cut to a_bounds."""
    if options.fix_a is not None:
        return np.array([options.fix_a])
    grid = np.array(options.a_grid if options.a_grid is not None else PAPER_A_GRID)
    lo, hi = options.a_bounds
    if options.widen_a_grid and window_pass_rate.size:
        top, bottom = float(window_pass_rate.max()), float(window_pass_rate.min())
        step = A_GRID_STEP
        if top > grid.max():
            grid = np.concatenate((grid, np.arange(grid.max() + step, hi + step / 2, step)))
        if top < grid.min():
            start = max(lo, math.floor(bottom / step) * step - step)
            grid = np.concatenate((np.arange(start, grid.min() - step / 2, step), grid))
    grid = np.round(grid, 6)
    grid = grid[(grid >= lo - 1e-12) & (grid <= hi + 1e-12)]
    if grid.size == 0:
        raise ValueError(f"a_grid has no value inside a_bounds {options.a_bounds!r}")
    return grid


def resolve_cmid_range(options: FitOptions, compute_max: float) -> tuple[float, float]:
    """Reference Cmid range: given, or the paper's [100, 40000] scaled to the data."""
    if options.cmid_range is not None:
        return options.cmid_range
    return compute_max * PAPER_CMID_SPAN[0], compute_max * PAPER_CMID_SPAN[1]


def resolve_cmid_bounds(options: FitOptions, compute_max: float) -> tuple[float, float]:
    """Fast-method Cmid bounds: given, or a superset of the reference grid's range."""
    if options.cmid_bounds is not None:
        return options.cmid_bounds
    lo, hi = resolve_cmid_range(options, compute_max)
    return lo / 10.0, hi * 4.0


def _pair(name: str, value: object) -> tuple[float, float]:
    try:
        lo, hi = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (lo, hi) pair of numbers, got {value!r}") from None
    return float(lo), float(hi)


DEFAULT_OPTIONS = FitOptions()
"""The defaults, shared (FitOptions is frozen) as the default argument of every entry point."""
