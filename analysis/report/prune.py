"""The live prune policy: `analysis.pruning`'s judgment applied to a running sweep (`sweep status`,
and the local scheduler through it). Like `analysis.report.build`, this layer reads the store (the
runs, their newest evals, the record kept on each run); `analysis.pruning` stays pure computation,
and launching and tracking (launcher/, except the CLI) never import either.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from analysis.options import DEFAULT_OPTIONS, FitOptions
from analysis.pruning import PrunePolicy, Verdict, judge
from store import ACTIVE_STATES, PRUNE_EXEMPT, EvalRecord, RunRecord, RunState, Store

# Each configuration's progress is that of its least advanced seed (steps, or the compute of its
# newest eval, over the budget; a completed run is at 1). The judgment points are fractions of
# the budget (`first_at`, then every `every`). Whenever a configuration passes one (or one drops
# out), every configuration past `first_at` is fitted on the data as they are (seeds pooled,
# exactly as `--dry-run`), and those with active runs that are dominated are pruned; the best is
# never pruned, and a configuration short of `first_at` is neither judged nor a reference. So
# nothing is fitted before the first judgment point, a fast configuration that passes its points
# early is judged again when the others catch up, and `sweep status` in a loop refits only when
# something passed a point. The word is kept on each run (`RunRecord.prune`): the judgment it last
# took part in, or the decision that pruned it; a prune, once decided, is never decided again.
# Runs resumed with `sweep launch --resume-pruned` are exempt from the policy from then on (the
# user overruled it), but still count as references.

JUDGED = "judged_at"
"""Key of the record of a kept run: the judgment point its configuration had passed when last judged."""
SEEN = "seen"
"""Key of the record of a kept run: which configurations had passed which point then (a hash)."""
EXEMPT = PRUNE_EXEMPT
"""Key of the record of a resumed run (Store.claim_pruned_runs writes it): never pruned again."""

_OUT_OF_PLAY = (RunState.FAILED, RunState.CANCELLED, RunState.TIMEOUT)


@dataclass(frozen=True)
class LivePrune:
    """One configuration to prune now: its active runs, the state reason and the decision record."""

    label: str
    run_ids: tuple[str, ...]
    reason: str
    record: dict[str, Any]


@dataclass(frozen=True)
class LiveJudgment:
    prunes: tuple[LivePrune, ...] = ()
    judged: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Records for the active runs of due configurations that were kept."""
    fitted: tuple[str, ...] = ()
    """The configurations fitted (empty: no judgment was due, nothing was fitted)."""


def policy_of(spec: Mapping[str, Any]) -> PrunePolicy | None:
    """The sweep's policy (its `prune:` block, stored with the sweep); None without one."""
    block = (spec.get("grid") or {}).get("prune")
    if block is None:
        return None
    try:
        return PrunePolicy(**(block or {}))
    except (TypeError, ValueError) as exc:  # a sweep registered before a bound was checked at launch
        from analysis.report.build import ReportError

        raise ReportError(
            f"the sweep's stored prune: block {block} is not a valid policy ({exc}); "
            "relaunch the sweep file with a valid prune: block"
        ) from None


def run_progress(run: RunRecord, last: EvalRecord | None) -> float:
    """How far a run is through its budget, in [0, 1]: the largest of steps / budget.steps and
    the newest eval's flops and GPU-hours over theirs (a run stops at the first budget reached)."""
    if run.state == RunState.COMPLETED:
        return 1.0
    budget, done = run.budget, [0.0]
    if budget.get("steps"):
        done.append(run.step / budget["steps"])
    for key in ("flops", "gpu_hours"):
        if budget.get(key) and last is not None:
            done.append(getattr(last, key) / budget[key])
    return min(1.0, max(done))


def live_judgment(
    store: Store,
    sweep: str,
    policy: PrunePolicy,
    *,
    compute: str | None = None,
    options: FitOptions = DEFAULT_OPTIONS,
) -> LiveJudgment:
    """What the policy says about the sweep now (nothing is written: `sweep status` applies it)."""
    from analysis.ranking import config_label
    from analysis.report.build import read_configurations

    runs = store.runs(sweep)
    if not any(r.state in ACTIVE_STATES for r in runs):
        return LiveJudgment()
    last = store.last_eval_points(sweep)
    configs: dict[str, list[RunRecord]] = {}
    for run in runs:
        label = config_label({k: v for k, v in run.axes.items() if k != "seed"}) or run.id
        configs.setdefault(label, []).append(run)
    points = policy.judgments()
    reached: dict[str, float] = {}  # configurations past first_at -> the newest judgment point passed
    candidates: dict[str, list[RunRecord]] = {}  # their active runs the policy may stop
    decided = {label for label, members in configs.items() if any(r.state == RunState.PRUNED for r in members)}
    for label, members in configs.items():
        if label in decided:
            continue
        playing = [r for r in members if r.state not in _OUT_OF_PLAY]
        if not playing:
            continue
        progress = min(run_progress(r, last.get(r.id)) for r in playing)
        passed = [f for f in points if f <= progress + 1e-9]
        if passed:
            reached[label] = passed[-1]
            candidates[label] = [r for r in members if r.state in ACTIVE_STATES and not (r.prune or {}).get(EXEMPT)]
    seen = _signature(reached, decided)
    due = {label: runs for label, runs in candidates.items() if any((r.prune or {}).get(SEEN) != seen for r in runs)}
    if not due:
        return LiveJudgment()
    axis, groups, _ = read_configurations(store, sweep, compute)
    curves = {
        label: [(c.compute, c.pass_rate) for c in groups.get(label, []) if c.compute] for label in reached
    }
    curves = {label: seeds for label, seeds in curves.items() if seeds}
    verdicts = judge(curves, policy, options)
    best = _best(verdicts)
    now = datetime.now(UTC).isoformat(timespec="seconds")
    dominated = {
        label for label in due if (v := verdicts.get(label)) is not None and v.pruned and v.A_interval is not None
    }
    seen = _signature({k: v for k, v in reached.items() if k not in dominated}, decided | dominated)  # after it
    prunes, kept = [], {}
    for label, members in due.items():
        verdict = verdicts.get(label)
        at = reached[label]
        if label in dominated and verdict is not None and verdict.A_interval is not None and best is not None:
            record = {
                "decision": "pruned", "at": at, "compute_axis": axis,
                "compute": max((max(c) for c, _ in curves[label]), default=0.0),
                "A": list(verdict.A_interval), "best": best, "best_A": list(verdicts[best].A_interval or ()),
                "margin": policy.margin, "level": policy.level, "n_boot": policy.n_boot,
                "reason": verdict.reason, "decided_at": now,
            }  # fmt: skip
            reason = f"pruned at {at:.0%} of its budget: {verdict.reason}"
            prunes.append(LivePrune(label, tuple(r.id for r in members), reason, record))
        else:
            interval = verdict.A_interval if verdict is not None else None
            for run in members:
                kept[run.id] = {JUDGED: at, SEEN: seen, "A": list(interval) if interval else None, "best": best}
    return LiveJudgment(tuple(prunes), kept, tuple(curves))


def _signature(reached: Mapping[str, float], pruned: set[str]) -> str:
    """Which configurations had passed which judgment point, and which are pruned: a judgment is
    due when it changes (a kept run records the one after its judgment)."""
    text = json.dumps([sorted(reached.items()), sorted(pruned)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _best(verdicts: Mapping[str, Verdict]) -> str | None:
    """The reference of a judgment, as `judge` chose it: the highest lower bound on A."""
    known = {k: v.A_interval for k, v in verdicts.items() if v.A_interval is not None}
    return max(known, key=lambda k: known[k][0]) if len(known) >= 2 else None


# ---------------------------------------------------------------------------------------------
# The live step and `sweep prune`, as the CLI calls them

Stop = Callable[[Store, str, Sequence[str], str, dict[str, Any]], list[str]]
"""Stops a configuration's runs after a checkpoint (launcher.cancel.prune, handed in by the CLI:
this layer reads the store and judges; stopping jobs is the launcher's)."""


def apply_live_policy(store: Store, sweep: str, stop: Stop) -> list[str]:
    """Apply the sweep's live prune policy: judge what is due, stop the runs of the dominated
    configurations with `stop`, record the word on every run judged; the ids pruned. A sweep
    without a `prune:` block costs one read."""
    record = store.get_sweep(sweep)
    policy = None if record is None else policy_of(record.spec)
    if policy is None:
        return []
    judgment = live_judgment(store, sweep, policy)
    store.set_prune_records(judgment.judged)
    return [run_id for p in judgment.prunes for run_id in stop(store, sweep, p.run_ids, p.reason, p.record)]


def prune_data(store: Store, sweep: str, *, simulate: bool, compute: str | None = None) -> dict[str, Any]:
    """`sweep prune`: what the policy would prune now (`simulate` False), or a replay of the
    sweep's curves in compute order beside a current-value pruner (`simulate` True), as JSON-able
    data. A sweep without points on the axis is a ReportError naming what is missing."""
    from analysis.pruning import simulate as replay
    from analysis.pruning import simulate_current
    from analysis.report.build import read_configurations, require_data, split_reruns

    record = store.get_sweep(sweep)
    policy = (policy_of(record.spec) if record else None) or PrunePolicy()
    axis, groups, _ = read_configurations(store, sweep, compute)
    require_data(store, sweep, axis, groups)
    groups, _ = split_reruns(store, sweep, groups)
    curves = {label: [(c.compute, c.pass_rate) for c in seeds if c.compute] for label, seeds in groups.items()}
    curves = {label: seeds for label, seeds in curves.items() if seeds}
    data: dict[str, Any] = {"sweep": sweep, "compute_axis": axis, "policy": dataclasses.asdict(policy)}
    if not simulate:
        return data | {"configurations": [dataclasses.asdict(v) for v in judge(curves, policy).values()]}
    return data | {"simulations": [_simulation_json(replay(curves, policy)), _simulation_json(simulate_current(curves, policy))]}


def _simulation_json(sim: Any) -> dict[str, Any]:
    return {
        "pruner": sim.pruner,
        "saved_fraction": sim.saved_fraction,
        "best": sim.best,
        "best_survived": sim.best_survived,
        "runs": [dataclasses.asdict(v) for v in sim.verdicts],
    }
