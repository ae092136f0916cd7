"""Where one run's prediction error comes from: the figures behind docs/predictions.md.

For one run (its eval points), with the prediction of the final pass rate made from the first 25%
and 50% of its compute (as `sweep report --fit-until F --predict 100%` makes it):

- eval noise: the binomial sd of one eval, sqrt(p (1 - p) / samples), at the final pass rate;
- wander: the step-to-step sd near the ceiling beyond the binomial part (the policy itself moves
  between evals): sqrt(total^2 - binomial^2), with total the first-difference sd of the points
  in the second half of the run (`analysis.diagnostics.noise_sd`);
- late drift: the change over the second half of the run that the fit on all points does not
  explain (the slope of its residuals there, times the second half's compute);
- early points: how many evals lie in the first 25% and 50%;
- weighting and early points together: the error when the same trajectory is thinned to one eval
  every `thin` steps (the old schedule), against the error with every point;
- B and Cmid: the relative width of their bootstrap intervals from the first half.

`python -m analysis.report.error_sources --db URL SWEEP` prints the table for every completed run.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import numpy as np

from analysis.diagnostics import noise_sd
from analysis.extrapolation import extrapolate
from analysis.fit import fit_curves
from analysis.options import DEFAULT_OPTIONS, FitOptions


@dataclass(frozen=True)
class RunErrors:
    run: str
    final: float
    binomial_sd: float
    total_sd: float
    wander_sd: float
    late_drift: float
    n_quarter: int
    n_half: int
    error_quarter: float | None
    error_half: float | None
    error_quarter_thinned: float | None
    error_half_thinned: float | None
    b_rel_width_half: float | None
    cmid_rel_width_half: float | None
    band_half_width_half: float | None


def run_errors(
    run: str,
    steps: np.ndarray,
    compute: np.ndarray,
    pass_rate: np.ndarray,
    *,
    samples: int,
    thin: int = 50,
    options: FitOptions = DEFAULT_OPTIONS,
    n_boot: int = 100,
) -> RunErrors:
    order = np.argsort(compute, kind="stable")
    steps, c, r = steps[order], compute[order], pass_rate[order]
    end = float(c[-1])
    full = fit_curves([(c, r)], options)
    second = c > end / 2
    final = float(np.mean(r[c >= 0.9 * end] + full.predict(end) - full.predict(c[c >= 0.9 * end]))) if full.ok else float(r[-1])
    binomial = math.sqrt(max(final * (1 - final), 0.0) / samples)
    total = noise_sd(r[second])
    wander = math.sqrt(max(total**2 - binomial**2, 0.0))
    drift = math.nan
    if full.ok and second.sum() >= 3:
        resid = r[second] - full.predict(c[second])
        slope = np.polyfit(c[second], resid, 1)[0]
        drift = float(slope * (end - end / 2))
    thinned = (steps % thin == 0) | (c == end)

    def error(mask: np.ndarray, fraction: float) -> tuple[float | None, object]:
        try:
            ex = extrapolate([(c[mask], r[mask])], options, fit_until=fraction * end, predict_at=end, n_boot=n_boot)
        except ValueError:
            return None, None
        return (float(ex.predicted) - final if ex.predicts else None), ex

    e_q, _ = error(np.ones_like(c, dtype=bool), 0.25)
    e_h, ex_h = error(np.ones_like(c, dtype=bool), 0.5)
    e_qt, _ = error(thinned, 0.25)
    e_ht, _ = error(thinned, 0.5)
    b_w = cmid_w = band = None
    if ex_h is not None and ex_h.predicts:  # type: ignore[attr-defined]
        boot = ex_h.bootstrap  # type: ignore[attr-defined]
        b_i, c_i = boot.interval("B"), boot.interval("Cmid")
        b_w = b_i.width / boot.fit.B if b_i.known else None
        cmid_w = c_i.width / boot.fit.Cmid if c_i.known else None
        band = (ex_h.band.hi - ex_h.band.lo) / 2  # type: ignore[attr-defined]
    return RunErrors(
        run=run, final=final, binomial_sd=binomial, total_sd=total, wander_sd=wander, late_drift=drift,
        n_quarter=int((c <= 0.25 * end).sum()), n_half=int((c <= 0.5 * end).sum()),
        error_quarter=e_q, error_half=e_h, error_quarter_thinned=e_qt, error_half_thinned=e_ht,
        b_rel_width_half=b_w, cmid_rel_width_half=cmid_w, band_half_width_half=band,
    )  # fmt: skip


HEADER = (
    "run", "final", "binom sd", "total sd", "wander sd", "late drift", "n<=25%", "n<=50%",
    "err@25%", f"err@25% thinned", "err@50%", "err@50% thinned", "B CI/B @50%", "Cmid CI/Cmid @50%", "band +-@50%",
)  # fmt: skip


def markdown(rows: list[RunErrors], labels: dict[str, str]) -> str:
    def f(v: float | None, spec: str = "+.3f") -> str:
        return "-" if v is None or not math.isfinite(v) else format(v, spec)

    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for e in rows:
        cells = [
            labels.get(e.run, e.run), f(e.final, ".3f"), f(e.binomial_sd, ".4f"), f(e.total_sd, ".4f"),
            f(e.wander_sd, ".4f"), f(e.late_drift), str(e.n_quarter), str(e.n_half), f(e.error_quarter),
            f(e.error_quarter_thinned), f(e.error_half), f(e.error_half_thinned), f(e.b_rel_width_half, ".2f"),
            f(e.cmid_rel_width_half, ".2f"), f(e.band_half_width_half, ".3f"),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from store import RunState, Store

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True)
    parser.add_argument("--compute", default="flops")
    parser.add_argument("--thin", type=int, default=50)
    parser.add_argument("sweep")
    args = parser.parse_args(argv)
    store = Store(args.db)
    points = store.sweep_eval_points(args.sweep)
    rows, labels = [], {}
    for run in store.runs(args.sweep):
        pts = points.get(run.id, [])
        if run.state != RunState.COMPLETED or len(pts) < 5:
            continue
        labels[run.id] = ", ".join(f"{k}={v}" for k, v in run.axes.items() if k != "seed") or run.id
        rows.append(
            run_errors(
                run.id,
                np.array([p.step for p in pts], dtype=float),
                np.array([float(getattr(p, args.compute)) for p in pts]),
                np.array([p.pass_rate for p in pts]),
                samples=int(pts[-1].num_samples),
                thin=args.thin,
            )
        )
    print(markdown(rows, labels), end="")


if __name__ == "__main__":
    main()
