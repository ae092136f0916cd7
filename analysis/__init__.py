"""Fits of the ScaleRL sigmoid R(C) = R0 + (A - R0) / (1 + (Cmid/C)^B) to pass-rate curves.

Pure computation on arrays (numpy and scipy only; no torch, no database): fitting (fast and the
paper's reference grid), bootstrap intervals, the paper's comparison rule, extrapolation and
per-axis effects. Results are frozen dataclasses.
"""

from analysis.comparison import PAPER_MARGIN, Comparison, compare
from analysis.curve import (
    FLAG_A_AT_BOUND,
    FLAG_CMID_BEYOND_DATA,
    FLAG_COLLAPSING,
    FLAG_FIT_FAILED,
    FLAG_TOO_FEW_POINTS,
    FLAGS,
    FitResult,
    predict,
    sigmoid,
)
from analysis.diagnostics import is_collapsing, noise_sd
from analysis.effects import AxisEffect, EffectOptions, GroupSummary, axis_effect, matched_axis_effect
from analysis.extrapolation import Extrapolation, extrapolate
from analysis.fit import fit_curves
from analysis.intervals import BootstrapResult, Interval, bootstrap
from analysis.noise import NoiseModel
from analysis.options import PAPER_A_GRID, FitOptions

__all__ = [
    "FLAGS",
    "FLAG_A_AT_BOUND",
    "FLAG_CMID_BEYOND_DATA",
    "FLAG_COLLAPSING",
    "FLAG_FIT_FAILED",
    "FLAG_TOO_FEW_POINTS",
    "PAPER_A_GRID",
    "PAPER_MARGIN",
    "AxisEffect",
    "BootstrapResult",
    "Comparison",
    "EffectOptions",
    "Extrapolation",
    "FitOptions",
    "FitResult",
    "GroupSummary",
    "Interval",
    "NoiseModel",
    "axis_effect",
    "matched_axis_effect",
    "bootstrap",
    "compare",
    "extrapolate",
    "fit_curves",
    "is_collapsing",
    "noise_sd",
    "predict",
    "sigmoid",
]
