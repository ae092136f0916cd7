"""Validation and normalisation of curve inputs: arrays in, sorted float arrays out.

A curve is a (compute, pass_rate) pair of 1-D arrays; several curves of one configuration (seeds)
are a list of such pairs. Everything downstream may then assume sorted, finite, in-range data.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

Curve = tuple[NDArray[np.float64], NDArray[np.float64]]
CurveLike = tuple[ArrayLike, ArrayLike]
CurvesLike = CurveLike | Sequence[CurveLike]


def as_curve(compute: ArrayLike, pass_rate: ArrayLike) -> Curve:
    """Check one curve and return it sorted by compute (stable, so equal computes keep order)."""
    c = np.asarray(compute, dtype=float)
    r = np.asarray(pass_rate, dtype=float)
    if c.ndim != 1:
        raise ValueError(f"compute must be 1-D, got shape {c.shape}")
    if r.shape != c.shape:
        raise ValueError(f"pass_rate must have the shape of compute {c.shape}, got {r.shape}")
    _check_finite("compute", c)
    _check_finite("pass_rate", r)
    if np.any(c < 0):
        raise ValueError(f"compute must be >= 0, got {float(c[c < 0][0])!r}")
    bad = (r < 0) | (r > 1)
    if np.any(bad):
        raise ValueError(f"pass_rate must lie in [0, 1], got {float(r[bad][0])!r}")
    order = np.argsort(c, kind="stable")
    return c[order], r[order]


def as_curves(data: CurvesLike) -> list[Curve]:
    """Accept one (compute, pass_rate) pair or a non-empty list of them (seeds of one config).

    Told apart by shape: a single pair's first element is a 1-D array of numbers, a list's first
    element is itself a pair.
    """
    if isinstance(data, (str, bytes)) or not isinstance(data, Sequence) or len(data) == 0:
        raise ValueError(f"curves must be a (compute, pass_rate) pair or a non-empty list of pairs, got {data!r:.80}")
    if len(data) == 2 and _is_1d_numeric(data[0]) and _is_1d_numeric(data[1]):
        return [as_curve(data[0], data[1])]  # type: ignore[arg-type]  # checked just above
    curves = []
    for i, item in enumerate(data):
        if not isinstance(item, Sequence) or len(item) != 2:
            raise ValueError(f"curves[{i}] must be a (compute, pass_rate) pair, got {item!r:.80}")
        curves.append(as_curve(item[0], item[1]))
    return curves


def _is_1d_numeric(x: object) -> bool:
    try:
        a = np.asarray(x)
    except ValueError:  # ragged nested sequences
        return False
    return a.ndim == 1 and (a.size == 0 or np.issubdtype(a.dtype, np.number))


def _check_finite(name: str, a: NDArray[np.float64]) -> None:
    bad = np.flatnonzero(~np.isfinite(a))
    if bad.size:
        raise ValueError(f"{name} must be finite, got {float(a[bad[0]])!r} at index {int(bad[0])}")
