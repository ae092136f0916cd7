"""Sweep files: load, validate, expand into runs.

A sweep file (README, "A sweep file") names a base recipe and the axes to vary. `load_sweep`
validates every key and value against RecipeConfig before anything touches the store; `expand`
is a pure function from the validated spec to the list of runs.

Expansion: points = cartesian product of the `grid` axes x the `zip` positions; for each point,
the point itself plus one run per `ablate` entry (the point with that one change); runs matching
an `exclude` entry are dropped (ablated runs too: an excluded combination never runs); each
remaining run once per seed; runs whose resolved configs are identical are one run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.yamlfile import YamlError, load_file, load_text
from recipe.config import (
    ConfigError,
    RecipeConfig,
    canonical_json,
    check_value,
    closest,
    flatten,
    resolve,
    tracking_block,
)

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # matched with fullmatch: `$` would allow "\n"
MAX_RUNS = 20_000
"""Default of `sweep launch --max-runs`: a bigger grid is almost always a typo (one more axis)."""
MAX_SEED = 2**32 - 1
NOT_AXES = {"seed": "seeds are the top-level `seeds:` list", "budget": "a sweep's runs share the top-level `budget:`"}
"""Recipe keys that sweep files set elsewhere: as an axis or in `recipe:` they would be overwritten."""
TOP_LEVEL_KEYS = (
    "name", "description", "recipe", "grid", "zip", "ablate", "exclude", "seeds", "budget", "resources", "prune",
    "tracking",
)  # fmt: skip
# The `prune:` block (scaling-aware pruning, analysis/pruning.py): key -> (type, lowest, highest,
# whether the lowest is allowed). `every` >= 0.001: at most 1,000 judgment points (MAX_JUDGMENTS).
PRUNE_KEYS: dict[str, tuple[type, float, float, bool]] = {
    "first_at": (float, 0.0, 1.0, False),  # fractions of the sweep's compute range, in (0, 1]
    "every": (float, 0.001, 1.0, True),
    "margin": (float, 0.0, 1.0, False),
    "level": (float, 0.5, 0.999, True),
    "n_boot": (int, 10, 10_000, True),
}
BUDGET_KEYS = ("steps", "gpu_hours", "flops")
# Cluster resources: a grid's `resources:` may set these, or name a profile file that does.
PROFILE_KEYS = (
    "partition",
    "account",
    "qos",
    "constraint",
    "gpus_per_node",
    "nodes",
    "cpus_per_task",
    "mem_gb",
    "timeout_min",
    "array_parallelism",
    "signal_delay_s",
    "setup",
)
RESOURCE_KEYS = ("profile", "generator_gpus", "tasks_per_node", *PROFILE_KEYS)
# key -> (type, smallest allowed value); `setup` is a list of shell lines.
RESOURCE_TYPES: dict[str, tuple[type, float | None]] = {
    "profile": (str, None),
    "partition": (str, None),
    "account": (str, None),
    "qos": (str, None),
    "constraint": (str, None),
    "gpus_per_node": (int, 0),
    "generator_gpus": (int, 0),
    "nodes": (int, 1),
    "tasks_per_node": (int, 1),
    "cpus_per_task": (int, 1),
    "mem_gb": (float, 0),
    "timeout_min": (int, 1),
    "array_parallelism": (int, 1),
    "signal_delay_s": (int, 0),
}
MAX_RESOURCE_INT = 10**6
RESOURCE_DEFAULTS: dict[str, Any] = {
    "nodes": 1,
    "cpus_per_task": 1,
    "timeout_min": 24 * 60,
    "signal_delay_s": 120,
    "array_parallelism": 256,
}


class GridError(ValueError):
    """A problem in a sweep file, naming the file, the key, the value and what is allowed."""

    def __init__(self, path: Path | str, key: str, message: str):
        super().__init__(f"{path}: {key}: {message}")
        self.path, self.key, self.detail = str(path), key, message


@dataclass(frozen=True)
class SweepSpec:
    name: str
    path: str
    recipe: dict[str, Any]  # dotted key -> value: the base every run starts from
    grid: dict[str, list[Any]]
    zip: list[dict[str, list[Any]]]
    ablate: list[dict[str, Any]]
    exclude: list[dict[str, Any]]
    seeds: list[int]
    resources: dict[str, Any]
    raw: dict[str, Any] = field(repr=False)  # the file as loaded, overrides applied

    @property
    def axis_keys(self) -> list[str]:
        """Recipe keys that vary across the sweep, in file order."""
        keys: list[str] = list(self.grid)
        for group in self.zip:
            keys += [k for k in group if k not in keys]
        for change in self.ablate:
            keys += [k for k in change if k not in keys]
        return keys


@dataclass(frozen=True)
class RunPlan:
    id: str
    position: int
    config: RecipeConfig
    axes: dict[str, Any]  # what distinguishes this run: axis values, seed, ablation

    @property
    def budget(self) -> dict[str, Any]:
        return dataclasses.asdict(self.config.budget)


# ---------------------------------------------------------------------------------------------
# Loading and validation


def load_sweep(path: str | Path, overrides: Sequence[str] = ()) -> SweepSpec:
    """Read a sweep file (strict YAML: `launcher.yamlfile`), apply `key=value` overrides, validate
    everything. Nothing here touches the store or the file system beyond reading."""
    path = Path(path)
    if not path.is_file():
        raise GridError(path, "file", "no such file" if not path.exists() else "not a regular file")
    try:
        raw = load_file(path)
    except YamlError as exc:
        raise GridError(exc.source, exc.location, exc.detail) from None
    if not isinstance(raw, dict):
        raise GridError(path, "file", f"the top level must be a mapping, got {type(raw).__name__}")
    for override in overrides:
        _apply_override(path, raw, override)
    return _validate(path, raw)


def _apply_override(path: Path, raw: dict[str, Any], text: str) -> None:
    """`key=value` (value in YAML). `grid.optim.lr=[...]` and `ablate.loss.type=x` address the
    axis `optim.lr` / `loss.type`: the part after the section is one dotted key."""
    where = f"override {text!r}"
    key, sep, value_text = text.partition("=")
    key = key.strip()
    if not sep:
        raise GridError(path, where, "expected KEY=VALUE (e.g. budget.steps=50); to unset a key write KEY=null")
    if not key or any(not part for part in key.split(".")):
        raise GridError(path, where, f"invalid key {key!r}: dotted names like recipe.optim.lr or grid.loss.type")
    try:
        value = load_text(value_text, where)
    except YamlError as exc:
        raise GridError(path, where, exc.detail) from None
    section, _, rest = key.partition(".")
    if section not in TOP_LEVEL_KEYS:
        hint = closest(section, TOP_LEVEL_KEYS)
        raise GridError(
            path, where, f"unknown key {section!r}{f' (did you mean {hint!r}?)' if hint else ''}; allowed: {', '.join(TOP_LEVEL_KEYS)}"
        )
    if not rest:
        raw[section] = value
        return
    node = raw.get(section)
    if node is None:
        node = raw[section] = {}
    if not isinstance(node, dict):
        raise GridError(path, where, f"{section} is a {type(node).__name__} in the file, not a mapping")
    if section in ("grid", "ablate"):
        node[rest] = value
        return
    parts = rest.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise GridError(path, where, f"{part} is not a mapping in the file")
        node = child
    node[parts[-1]] = value


def _validate(path: Path, raw: dict[str, Any]) -> SweepSpec:
    _known_keys(path, "", raw, TOP_LEVEL_KEYS)
    name = raw.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise GridError(
            path,
            "name",
            f"invalid sweep name {name!r}: 1-64 characters of letters, digits, '.', '_', '-', not starting with '.', '_' or '-'",
        )

    recipe = _mapping(path, raw, "recipe")
    base = {k: _check(path, f"recipe.{k}", k, v) for k, v in flatten(recipe).items()}
    if "seed" in base:
        raise GridError(path, "recipe.seed", f"{base['seed']!r} would be overwritten: {NOT_AXES['seed']} (e.g. seeds: [{base['seed']}])")
    base.update(_budget(path, raw))

    grid = {k: _values(path, f"grid.{k}", k, v) for k, v in _mapping(path, raw, "grid").items()}
    zips = [_zip_group(path, i, group) for i, group in enumerate(_list(path, raw, "zip"))]
    ablate = _ablate(path, raw.get("ablate"))
    exclude = [_change(path, f"exclude[{i}]", e) for i, e in enumerate(_list(path, raw, "exclude"))]
    seeds = _seeds(path, raw.get("seeds", [0]))
    resources = _resources(path, _mapping(path, raw, "resources"))
    _prune(path, _mapping(path, raw, "prune"))
    try:
        tracking_block(raw.get("tracking"))
    except ConfigError as exc:
        raise GridError(path, exc.key, exc.detail) from None

    varied = list(grid)
    for i, group in enumerate(zips):
        for key in group:
            if key in varied:
                raise GridError(
                    path, f"zip[{i}].{key}", "this key is already an axis; an axis can vary in one place only"
                )
            varied.append(key)

    spec = SweepSpec(
        name=name, path=str(path), recipe=base, grid=grid, zip=zips, ablate=ablate,
        exclude=exclude, seeds=seeds, resources=resources, raw=raw,
    )  # fmt: skip
    return spec


def _check(path: Path, where: str, key: str, value: Any) -> Any:
    head = key.split(".")[0]
    if head in NOT_AXES and where.split(".")[0].split("[")[0] in ("grid", "zip", "ablate"):
        raise GridError(path, where, f"{key} cannot vary inside a sweep: {NOT_AXES[head]}")
    try:
        return check_value(key, value)
    except ConfigError as exc:
        raise GridError(path, where, exc.detail) from None


def _mapping(path: Path, raw: dict[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise GridError(path, key, f"must be a mapping, got {type(value).__name__} {value!r}")
    return value


def _list(path: Path, raw: dict[str, Any], key: str) -> list[Any]:
    value = raw.get(key) or []
    if not isinstance(value, list):
        raise GridError(path, key, f"must be a list, got {type(value).__name__} {value!r}")
    return value


def _values(path: Path, where: str, key: str, values: Any, *, unique: bool = True) -> list[Any]:
    if not isinstance(values, list) or not values:
        raise GridError(path, where, f"an axis takes a non-empty list of values, got {values!r}")
    checked = [_check(path, where, key, v) for v in values]
    if unique and len({repr(v) for v in checked}) != len(checked):
        raise GridError(path, where, f"repeated values in {values!r}")
    return checked


def _zip_group(path: Path, index: int, group: Any) -> dict[str, list[Any]]:
    where = f"zip[{index}]"
    if not isinstance(group, dict) or not group:
        raise GridError(path, where, f"each zip entry is a mapping of axes to equally long lists, got {group!r}")
    out = {k: _values(path, f"{where}.{k}", k, v, unique=False) for k, v in group.items()}
    lengths = {k: len(v) for k, v in out.items()}
    if len(set(lengths.values())) > 1:
        raise GridError(path, where, f"zipped axes must have equal lengths, got {lengths}")
    return out


def _change(path: Path, where: str, entry: Any) -> dict[str, Any]:
    if not isinstance(entry, dict) or not entry:
        raise GridError(path, where, f"must be a mapping of recipe keys to values, got {entry!r}")
    return {k: _check(path, f"{where}.{k}", k, v) for k, v in flatten(entry).items()}


def _ablate(path: Path, raw: Any) -> list[dict[str, Any]]:
    """`{key: value, ...}`: one entry per key; or a list of mappings for multi-key changes."""
    if raw is None:
        return []
    if isinstance(raw, dict):
        return [{k: _check(path, f"ablate.{k}", k, v)} for k, v in flatten(raw).items()]
    if isinstance(raw, list):
        return [_change(path, f"ablate[{i}]", e) for i, e in enumerate(raw)]
    raise GridError(path, "ablate", f"must be a mapping or a list of mappings, got {raw!r}")


def _seeds(path: Path, raw: Any) -> list[int]:
    seeds = raw if isinstance(raw, list) else [raw]
    if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_SEED for s in seeds):
        bad = next((s for s in seeds if not (isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_SEED)), raw)
        raise GridError(
            path, "seeds", f"invalid seed {bad!r}: an integer in [0, {MAX_SEED}] or a non-empty list of them"
        )
    if len(set(seeds)) != len(seeds):
        raise GridError(path, "seeds", f"repeated seeds in {raw!r}")
    return seeds


def _budget(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """The sweep's `budget:` replaces the recipe's budget as a whole (unset limits are off)."""
    budget = _mapping(path, raw, "budget")
    if not budget:
        return {}
    _known_keys(path, "budget", budget, BUDGET_KEYS)
    return {f"budget.{k}": _check(path, f"budget.{k}", f"budget.{k}", budget.get(k)) for k in BUDGET_KEYS}


def _resources(path: Path, resources: dict[str, Any]) -> dict[str, Any]:
    """The grid's `resources:` over its cluster profile (if any) over the defaults."""
    _known_keys(path, "resources", resources, RESOURCE_KEYS)
    _check_resources(path, "resources", resources)
    merged = dict(RESOURCE_DEFAULTS)
    if resources.get("profile"):
        merged.update(load_profile(path, str(resources["profile"])))
    merged.update(resources)
    return merged


def _check_resources(path: Path, section: str, resources: dict[str, Any]) -> None:
    """Types and ranges of cluster resources, in a grid's `resources:` or a profile."""
    for key, value in resources.items():
        where = f"{section}.{key}" if section else key
        if key == "setup":
            if not isinstance(value, list) or not all(isinstance(line, str) for line in value):
                raise GridError(path, where, f"invalid value {value!r}; expected a list of shell lines (strings)")
            continue
        tp, lo = RESOURCE_TYPES[key]
        if value is None:
            continue
        if tp is str:
            if not isinstance(value, str) or not value.strip() or "\n" in value:
                raise GridError(path, where, f"invalid value {value!r}; expected a non-empty one-line string")
            continue
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if tp is int and not (isinstance(value, int) and not isinstance(value, bool)):
            raise GridError(path, where, f"invalid value {value!r}; expected an integer >= {lo}")
        if tp is float and (not numeric or not math.isfinite(value)):
            raise GridError(path, where, f"invalid value {value!r}; expected a number > {lo}")
        if lo is not None and (value < lo or (tp is float and value == lo)):
            bound = f"> {lo}" if tp is float else f">= {lo}"
            raise GridError(path, where, f"invalid value {value!r}; must be {bound}")
        if value > MAX_RESOURCE_INT:
            raise GridError(path, where, f"invalid value {value!r}; must be <= {MAX_RESOURCE_INT}")


def _prune(path: Path, prune: dict[str, Any]) -> None:
    _known_keys(path, "prune", prune, tuple(PRUNE_KEYS))
    for key, value in prune.items():
        tp, lo, hi, lo_allowed = PRUNE_KEYS[key]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = number and (tp is float or isinstance(value, int)) and math.isfinite(value)
        ok = ok and (lo <= value if lo_allowed else lo < value) and value <= hi
        if not ok:
            kind = "an integer" if tp is int else "a number"
            allowed = f"{'[' if lo_allowed else '('}{lo:g}, {hi:g}]"
            raise GridError(path, f"prune.{key}", f"invalid value {value!r}; expected {kind} in {allowed}")


def load_profile(grid_path: Path, profile: str) -> dict[str, Any]:
    """A cluster profile (slurm/profiles/*.yaml), relative to the grid file or the working dir."""
    candidates = [Path(profile)] if Path(profile).is_absolute() else [grid_path.parent / profile, Path.cwd() / profile]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        raise GridError(grid_path, "resources.profile", f"no cluster profile at {' or '.join(map(str, candidates))}")
    try:
        data = load_file(found)
    except YamlError as exc:
        raise GridError(exc.source, exc.location, exc.detail) from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise GridError(found, "file", f"a cluster profile is a mapping, got {type(data).__name__}")
    _known_keys(found, "", data, PROFILE_KEYS)
    _check_resources(found, "", data)
    return data


def _known_keys(path: Path, section: str, mapping: dict[str, Any], allowed: Sequence[str]) -> None:
    for key in mapping:
        if key not in allowed:
            hint = closest(str(key), allowed)
            where = f"{section}.{key}" if section else str(key)
            raise GridError(
                path, where, f"unknown key{f' (did you mean {hint!r}?)' if hint else ''}; allowed: {', '.join(allowed)}"
            )


# ---------------------------------------------------------------------------------------------
# Expansion (pure)


def count_runs(spec: SweepSpec) -> int:
    """An upper bound of the sweep's runs from the axis sizes alone (before exclusions and
    de-duplication), computed without expanding anything."""
    count = math.prod(len(values) for values in spec.grid.values())
    count *= math.prod(len(next(iter(group.values()))) for group in spec.zip)
    return count * (1 + len(spec.ablate)) * len(spec.seeds)


def check_size(spec: SweepSpec, max_runs: int = MAX_RUNS) -> None:
    count = count_runs(spec)
    if count > max_runs:
        sizes = " x ".join(
            [f"{len(v)} ({k})" for k, v in spec.grid.items()]
            + [f"{len(next(iter(g.values())))} (zip[{i}])" for i, g in enumerate(spec.zip)]
            + ([f"{1 + len(spec.ablate)} (base + ablate)"] if spec.ablate else [])
            + ([f"{len(spec.seeds)} (seeds)"] if len(spec.seeds) > 1 else [])
        )
        raise GridError(
            spec.path, "grid", f"expands to {count:,} runs ({sizes}), above the limit of {max_runs:,}; "
            "raise it with --max-runs if you mean it"
        )


def expand(spec: SweepSpec) -> list[RunPlan]:
    """The runs of a sweep, in a stable order, without duplicates."""
    return expand_with_warnings(spec)[0]


def expand_with_warnings(spec: SweepSpec) -> tuple[list[RunPlan], list[str]]:
    """`expand`, plus a warning per `exclude` entry that matched no run. Excluding every run is
    an error: a sweep without runs is a mistake, not something to register."""
    matched = [0] * len(spec.exclude)
    plans = _expand(spec, matched)
    if not plans:
        raise GridError(spec.path, "exclude", "every run is excluded: nothing to launch")
    warnings = [
        f"{spec.path}: exclude[{i}]: {_label(entry)} matches no run" for i, entry in enumerate(spec.exclude) if not matched[i]
    ]
    return plans, warnings


def _expand(spec: SweepSpec, matched: list[int]) -> list[RunPlan]:
    points: list[dict[str, Any]] = [{}]
    for key, values in spec.grid.items():
        points = [p | {key: v} for p in points for v in values]
    for group in spec.zip:
        positions = [dict(zip(group, vals, strict=False)) for vals in zip(*group.values(), strict=False)]
        points = [p | pos for p in points for pos in positions]

    variants: list[tuple[dict[str, Any], str | None]] = []
    for point in points:
        variants.append((point, None))
        variants += [(point | change, _label(change)) for change in spec.ablate]

    resolved: list[tuple[str, RecipeConfig, str | None, int]] = []
    for point_values, ablation in variants:
        for seed in spec.seeds:
            config = _resolve(spec, {**spec.recipe, **point_values, "seed": seed}, point_values)
            if not _excluded(spec, config, matched):
                resolved.append((run_id(spec.name, config), config, ablation, seed))
    # An ablation that lands on another grid point is that point: label it as the point.
    grid_point_ids = {rid for rid, _, ablation, _ in resolved if ablation is None}

    axis_keys = spec.axis_keys
    plans: list[RunPlan] = []
    seen: set[str] = set()
    for rid, config, ablation, seed in resolved:
        if rid in seen or (ablation is not None and rid in grid_point_ids):
            continue
        seen.add(rid)
        axes = {k: config.get(k) for k in axis_keys}
        if spec.ablate:
            axes["ablate"] = ablation or "base"
        if len(spec.seeds) > 1:
            axes["seed"] = seed
        plans.append(RunPlan(id=rid, position=len(plans), config=config, axes=axes))
    return plans


def run_id(sweep_name: str, config: RecipeConfig) -> str:
    """Short hash of the sweep name and the resolved config, budget left out: raising a sweep's
    budget extends its runs instead of starting new ones."""
    body = config.to_dict()
    body.pop("budget")
    return hashlib.sha256(f"{sweep_name}\n{canonical_json(body)}".encode()).hexdigest()[:12]


def _resolve(spec: SweepSpec, flat: dict[str, Any], values: dict[str, Any]) -> RecipeConfig:
    try:
        return resolve(flat)
    except ConfigError as exc:
        at = ", ".join(f"{k}={v}" for k, v in values.items()) or "the base recipe"
        raise GridError(spec.path, exc.key, f"{exc.detail} (in the run with {at})") from None


def _excluded(spec: SweepSpec, config: RecipeConfig, matched: list[int]) -> bool:
    hit = False
    for i, entry in enumerate(spec.exclude):
        if all(config.get(k) == v for k, v in entry.items()):
            matched[i] += 1
            hit = True
    return hit


def _label(change: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in change.items())
