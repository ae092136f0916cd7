"""Numerical core of the fast method: a batched, bounded Levenberg-Marquardt and its start points.

Parameters live in an internal vector theta = [A, ln B, ln Cmid, R0]: logs make B > 0 and Cmid > 0
automatic and put Cmid (hundreds to hundreds of thousands of GPU-hours) on the same footing as the
others. Each parameter is either free within [lo, hi] or held at the value given in theta.

Why a hand-written solver: a bootstrap refits the same design (the same compute points) K times
with different pass rates, and scipy.optimize.least_squares costs ~1 ms per call in Python
overhead alone. Stepping all K problems at once in numpy makes 200 refits cost about as much as a
handful of scalar ones; that is what makes a 1,000-curve report with bootstrap intervals take
seconds rather than minutes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from analysis.curve import logistic

I_A, I_LNB, I_LNC, I_R0 = 0, 1, 2, 3
NUM_PARAMS = 4

_LAMBDA_START = 1e-3
_LAMBDA_MIN, _LAMBDA_MAX = 1e-12, 1e12
_SSE_FLOOR = 1e-26  # below this a noise-free fit is exact to float precision


@dataclass(frozen=True)
class Space:
    """Search space in theta coordinates: bounds for free parameters, a mask of which are free."""

    lo: NDArray[np.float64]
    hi: NDArray[np.float64]
    free: NDArray[np.bool_]

    def clip(self, theta: NDArray[np.float64]) -> NDArray[np.float64]:
        """Clip the free parameters of theta (K, 4) into bounds; fixed ones are left alone."""
        out = theta.copy()
        out[:, self.free] = np.clip(theta[:, self.free], self.lo[self.free], self.hi[self.free])
        return out


@dataclass(frozen=True)
class Design:
    """The compute points of a problem, pre-processed once: log C, and which C are > 0."""

    log_c: NDArray[np.float64]  # ln C, with 0 where C == 0 (masked out by `pos`)
    pos: NDArray[np.bool_]

    @classmethod
    def from_compute(cls, compute: NDArray[np.float64]) -> Design:
        pos = compute > 0
        return cls(np.log(np.where(pos, compute, 1.0)), pos)


@dataclass(frozen=True)
class LMResult:
    theta: NDArray[np.float64]  # (K, 4)
    sse: NDArray[np.float64]  # (K,)
    converged: NDArray[np.bool_]  # (K,)


def model(theta: NDArray[np.float64], design: Design) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Curve values f (K, n) and the gain fraction g (K, n) for each row of theta (K, 4)."""
    b = np.exp(theta[:, I_LNB])[:, None]
    z = b * (design.log_c[None, :] - theta[:, I_LNC][:, None])
    g = np.where(design.pos, logistic(z), 0.0)
    a, r0 = theta[:, I_A][:, None], theta[:, I_R0][:, None]
    return r0 + (a - r0) * g, g


def model_and_jac(theta: NDArray[np.float64], design: Design) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """f (K, n) and its Jacobian df/dtheta (K, n, 4), analytic (2-3x cheaper than differences)."""
    b = np.exp(theta[:, I_LNB])[:, None]
    x = np.where(design.pos, design.log_c[None, :] - theta[:, I_LNC][:, None], 0.0)
    z = b * x
    g = np.where(design.pos, logistic(z), 0.0)
    a, r0 = theta[:, I_A][:, None], theta[:, I_R0][:, None]
    gain = a - r0
    slope = gain * g * (1.0 - g)  # d f / d z
    jac = np.empty(g.shape + (NUM_PARAMS,))
    jac[..., I_A] = g
    jac[..., I_LNB] = slope * z  # dz/d lnB = z
    jac[..., I_LNC] = -slope * b  # dz/d lnCmid = -B
    jac[..., I_R0] = 1.0 - g
    return r0 + gain * g, jac


def levenberg_marquardt(
    theta0: NDArray[np.float64],
    y: NDArray[np.float64],
    design: Design,
    space: Space,
    *,
    weights: NDArray[np.float64] | None = None,
    max_iter: int = 100,
    ftol: float = 1e-10,
    xtol: float = 1e-10,
) -> LMResult:
    """Minimise sum w_k (y_k - f(theta_k))^2 for K problems at once, from theta0 (K, 4).

    y is (K, n) (one pass-rate vector per problem) or (n,) (the same data from K starts);
    weights (K, n) or (n,), default 1 (integer weights = points drawn that many times).
    Bounds are honoured by projection with an active set: a parameter sitting on a bound whose
    gradient points outward is frozen for that step, so the others still take full Gauss-Newton
    steps instead of being dragged into tiny projected-gradient ones. A problem stops when an
    accepted step improves its SSE by less than `ftol` (relative) or moves theta by less than
    `xtol` (relative), or when damping saturates (no descent left).
    """
    num = theta0.shape[0]
    theta = space.clip(np.asarray(theta0, dtype=float))
    y = np.broadcast_to(np.asarray(y, dtype=float), (num, design.log_c.size))
    free = np.flatnonzero(space.free)
    lo, hi = space.lo[free], space.hi[free]
    root_w = None if weights is None else np.broadcast_to(np.sqrt(np.asarray(weights, dtype=float)), y.shape)

    def evaluate(th_rows: NDArray[np.float64], rows: NDArray[np.int64] | slice) -> tuple[NDArray[np.float64], ...]:
        f, j = model_and_jac(th_rows, design)
        r = y[rows] - f
        if root_w is not None:
            r, j = r * root_w[rows], j * root_w[rows][..., None]
        return r, j, np.einsum("kn,kn->k", r, r)

    resid, jac, sse = evaluate(theta, slice(None))
    lam = np.full(num, _LAMBDA_START)
    done = ~np.isfinite(sse) | (sse <= _SSE_FLOOR)
    converged = sse <= _SSE_FLOOR
    eye = np.eye(free.size)
    for _ in range(max_iter):
        act = np.flatnonzero(~done)
        if act.size == 0:
            break
        j_act = jac[act][:, :, free]
        grad = np.einsum("knp,kn->kp", j_act, resid[act])  # descent direction J^T r
        hess = np.einsum("knp,knq->kpq", j_act, j_act)
        th = theta[act][:, free]
        span = np.maximum(hi - lo, 1e-12)
        frozen = ((th <= lo + 1e-12 * span) & (grad < 0)) | ((th >= hi - 1e-12 * span) & (grad > 0))
        diag = np.einsum("kpp->kp", hess)
        diag = np.maximum(diag, 1e-12 * (diag.max(axis=1, keepdims=True) + 1e-30))
        mat = hess + lam[act][:, None, None] * diag[:, :, None] * eye
        keep = ~frozen
        mat = mat * (keep[:, :, None] & keep[:, None, :]) + frozen[:, :, None] * eye
        grad = np.where(frozen, 0.0, grad)
        step = _solve(mat, grad)
        th_new = np.clip(th + step, lo, hi)
        theta_new = theta[act].copy()
        theta_new[:, free] = th_new
        resid_new, jac_new, sse_new = evaluate(theta_new, act)
        better = np.isfinite(sse_new) & (sse_new < sse[act])
        rel_gain = (sse[act] - sse_new) / np.maximum(sse[act], 1e-300)
        tiny_step = np.all(np.abs(th_new - th) <= xtol * (1.0 + np.abs(th)), axis=1)
        acc = act[better]
        theta[acc], jac[acc], resid[acc], sse[acc] = (
            theta_new[better],
            jac_new[better],
            resid_new[better],
            sse_new[better],
        )
        lam[act] = np.clip(np.where(better, lam[act] / 3.0, lam[act] * 4.0), _LAMBDA_MIN, _LAMBDA_MAX)
        stop = (better & (rel_gain < ftol)) | tiny_step | (lam[act] >= _LAMBDA_MAX) | (sse[act] <= _SSE_FLOOR)
        done[act[stop]] = True
        converged[act[stop]] = True
    return LMResult(theta, sse, converged)


def _solve(mat: NDArray[np.float64], rhs: NDArray[np.float64]) -> NDArray[np.float64]:
    """Batched solve; a singular system (degenerate curve) gets a least-squares step instead."""
    try:
        step = np.linalg.solve(mat, rhs[..., None])[..., 0]
    except np.linalg.LinAlgError:
        step = np.einsum("kpq,kq->kp", np.linalg.pinv(mat), rhs)
    return np.asarray(step, dtype=np.float64)


def profile_starts(
    y: NDArray[np.float64],
    design: Design,
    space: Space,
    fixed: NDArray[np.float64],
    *,
    num_b: int = 24,
    num_cmid: int = 40,
    num_starts: int = 6,
) -> NDArray[np.float64]:
    """Data-driven start points: a coarse (B, Cmid) grid with A (and R0) solved in closed form.

    For fixed B and Cmid the curve is linear in A and R0 (f = R0 (1 - g) + A g), so the best A
    (and R0) at each grid point is a tiny least-squares solve: the grid covers the only nonlinear
    directions, log-spaced over their whole bounds, at the cost of a few array operations.
    Returns up to `num_starts` rows of theta (K, 4), best first: the local minima of the profile
    surface over (B, Cmid), i.e. distinct basins such as "saturating early", "still rising" or
    "a near step". `fixed` is a theta row holding fixed parameters.
    """
    lnb = _grid(space, I_LNB, num_b, fixed)
    lnc = _grid(space, I_LNC, num_cmid, fixed)
    z = np.exp(lnb)[:, None, None] * (design.log_c[None, None, :] - lnc[None, :, None])
    g = np.where(design.pos, logistic(z), 0.0)  # (num_b, num_cmid, n)
    a, r0 = _linear_params(y, g, space, fixed)
    f = r0[..., None] + (a - r0)[..., None] * g
    sse = np.sum((y - f) ** 2, axis=-1)
    sse = np.where(np.isfinite(sse), sse, np.inf)
    ib, ic = _local_minima(sse)
    best = np.argsort(sse[ib, ic], kind="stable")[:num_starts]
    ib, ic = ib[best], ic[best]
    starts = np.tile(fixed, (ib.size, 1))
    starts[:, I_A] = a[ib, ic]
    starts[:, I_LNB] = lnb[ib]
    starts[:, I_LNC] = lnc[ic]
    starts[:, I_R0] = r0[ib, ic]
    return starts


def step_start(
    y: NDArray[np.float64], design: Design, space: Space, fixed: NDArray[np.float64]
) -> NDArray[np.float64] | None:
    """The best near-step curve (B at its upper bound, Cmid between two evals) as a theta row.

    A step is the B -> infinity end of the model: R0 before Cmid, A after. Its squared error is
    flat in Cmid between two evals, so no gradient method finds the best split from elsewhere,
    yet on a flat, noisy run the best fit can be (nearly) a step, and the reference's grid can
    land on one. All n - 1 splits are scored at once with cumulative sums. None if no split.
    """
    order = np.argsort(np.where(design.pos, design.log_c, -np.inf), kind="stable")
    lc = np.where(design.pos, design.log_c, -np.inf)[order]
    ys = y[order]
    split = np.flatnonzero((lc[1:] > lc[:-1]) & np.isfinite(lc[1:])) + 1  # first point after the step
    if split.size == 0:
        return None
    s1 = np.concatenate(([0.0], np.cumsum(ys)))
    s2 = np.concatenate(([0.0], np.cumsum(ys**2)))
    n = ys.size
    lo_n, hi_n = split, n - split
    lo_sum, hi_sum = s1[split], s1[n] - s1[split]
    lo_sq, hi_sq = s2[split], s2[n] - s2[split]
    r0 = lo_sum / lo_n if space.free[I_R0] else np.full(split.size, fixed[I_R0])
    a = hi_sum / hi_n if space.free[I_A] else np.full(split.size, fixed[I_A])
    a = np.clip(a, space.lo[I_A], space.hi[I_A]) if space.free[I_A] else a
    r0 = np.clip(r0, space.lo[I_R0], space.hi[I_R0]) if space.free[I_R0] else r0
    sse = (lo_sq - 2 * r0 * lo_sum + lo_n * r0**2) + (hi_sq - 2 * a * hi_sum + hi_n * a**2)
    k = int(np.argmin(sse))
    before = lc[split[k] - 1] if np.isfinite(lc[split[k] - 1]) else lc[split[k]] - 1.0
    theta = fixed.copy()
    theta[I_A], theta[I_R0] = a[k], r0[k]
    theta[I_LNB] = space.hi[I_LNB]
    theta[I_LNC] = np.clip((before + lc[split[k]]) / 2, space.lo[I_LNC], space.hi[I_LNC])
    return theta


def _local_minima(surface: NDArray[np.float64]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Indices of the points of a 2-D surface no higher than any of their 8 neighbours (at least
    the global minimum)."""
    padded = np.pad(surface, 1, constant_values=np.inf)
    rows, cols = surface.shape
    is_min = np.isfinite(surface)
    for dr in (-1, 0, 1):
        for dc in (-1, 0, 1):
            if dr or dc:
                is_min &= surface <= padded[1 + dr : 1 + dr + rows, 1 + dc : 1 + dc + cols]
    if not is_min.any():
        return tuple(np.array([i]) for i in np.unravel_index(np.argmin(surface), surface.shape))  # type: ignore[return-value]
    ib, ic = np.nonzero(is_min)
    return ib.astype(np.int64), ic.astype(np.int64)


def _grid(space: Space, i: int, num: int, fixed: NDArray[np.float64]) -> NDArray[np.float64]:
    if not space.free[i]:
        return np.array([fixed[i]])
    return np.linspace(space.lo[i], space.hi[i], num)


def _linear_params(
    y: NDArray[np.float64], g: NDArray[np.float64], space: Space, fixed: NDArray[np.float64]
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Least-squares A and R0 for each gain-fraction vector in g (..., n), clipped to bounds."""
    shape = g.shape[:-1]
    free_a, free_r0 = bool(space.free[I_A]), bool(space.free[I_R0])
    tiny = 1e-300
    if free_a and free_r0:
        u = 1.0 - g
        uu, uv, vv = np.sum(u * u, -1), np.sum(u * g, -1), np.sum(g * g, -1)
        uy, vy = np.sum(u * y, -1), np.sum(g * y, -1)
        det = uu * vv - uv * uv
        ok = det > 1e-12 * np.maximum(uu * vv, tiny)
        r0 = np.where(ok, (vv * uy - uv * vy) / np.where(ok, det, 1.0), np.mean(y))
        a = np.where(ok, (uu * vy - uv * uy) / np.where(ok, det, 1.0), np.mean(y))
    elif free_a:
        r0 = np.full(shape, fixed[I_R0])
        gg = np.sum(g * g, -1)
        a = r0 + np.sum(g * (y - r0[..., None]), -1) / np.maximum(gg, tiny)
    elif free_r0:
        a = np.full(shape, fixed[I_A])
        u = 1.0 - g
        r0 = np.sum(u * (y - a[..., None] * g), -1) / np.maximum(np.sum(u * u, -1), tiny)
    else:
        a, r0 = np.full(shape, fixed[I_A]), np.full(shape, fixed[I_R0])
    if free_a:
        a = np.clip(a, space.lo[I_A], space.hi[I_A])
    if free_r0:
        r0 = np.clip(r0, space.lo[I_R0], space.hi[I_R0])
    return a, r0
