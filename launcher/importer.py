"""`sweep import`: pass-rate curves from elsewhere into a sweep, to be fitted and ranked beside
native runs (TRL, verl or W&B exports, points read off a published figure).

The file is CSV (a header row) or JSONL (one JSON object per line), told apart by its extension
(.csv; .jsonl or .ndjson) or by `fmt`. One row is one evaluation:

    run        name of the run the row belongs to                      (required)
    compute    compute spent when it was measured, >= 0                (required)
    pass_rate  held-out pass rate, in [0, 1]                           (required)
    step       training step, an integer >= 0, unique within the run  (optional)
    any other  a label of the run: loss=cispo, lr=1e-6, seed=0, ...

Rules, and why:
- Each distinct `run` is one run of the sweep; its id is a short hash of the sweep and run name,
  so importing the same file again updates the same runs (points are upserted by step) and adds
  nothing.
- Labels are the run's axes, so imported runs group into configurations, rank and show effects
  like a grid's runs. A label is constant within a run: a run whose rows disagree is an error
  (an empty cell or a missing key says nothing; it is not a disagreement). A label named `seed`
  (an integer) is the run's seed: runs that share every other label are one configuration and
  are fitted jointly. A run with no label but `seed` gets the label `run: <name>`, so that it is
  a configuration of its own, named as in the file rather than by its hash.
- Without `step`, a point's step is its order within its run (0, 1, ...); a file gives steps
  for all of a run's rows or for none.
- `compute` goes into the chosen compute column (gpu_hours by default; flops, tokens,
  device_seconds) and the others are 0: report with `sweep report --compute AXIS` unless it is
  gpu_hours.
- Imported runs are `completed`, with one attempt of executor `import` and no run directory. A
  sweep that does not exist yet is created with executor `import`; an existing sweep (native
  runs) keeps its settings.
- Every row is checked before anything is written: one bad row (errors name the file and the
  line) leaves the store as it was.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from launcher.grid import NAME_RE
from store import MEASURED_COMPUTE_AXES, RUN_STATES, AttemptState, NewRun, RunState, Store

IMPORT_FORMATS = ("csv", "jsonl")
REQUIRED = ("run", "compute", "pass_rate")
RESERVED = (*REQUIRED, "step")
EXECUTOR = "import"
MAX_ERRORS_SHOWN = 20
_EXTENSIONS = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}


class ImportFileError(ValueError):
    """The file cannot be imported; `errors` are lines of `FILE:LINE: what is wrong`."""

    def __init__(self, path: Path, errors: Sequence[str]):
        self.errors = list(errors)
        shown = self.errors[:MAX_ERRORS_SHOWN]
        more = len(self.errors) - len(shown)
        if len(self.errors) == 1:
            super().__init__(f"{self.errors[0]} (nothing was written)")
            return
        lines = [f"cannot import {path}; nothing was written:", *shown]
        if more:
            lines.append(f"... and {more} more")
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class Row:
    """One row of the file as read: its line number and its non-empty fields."""

    line: int
    fields: dict[str, Any]


@dataclass
class ImportedRun:
    """One run to write: its points in file order, its labels, and where they came from."""

    name: str
    first_line: int
    labels: dict[str, Any] = field(default_factory=dict)
    label_lines: dict[str, int] = field(default_factory=dict)
    points: list[dict[str, Any]] = field(default_factory=list)
    step_lines: dict[int, int] = field(default_factory=dict)
    stepless_line: int | None = None  # the first row without a step

    def id(self, sweep: str) -> str:
        return run_id(sweep, self.name)

    @property
    def axes(self) -> dict[str, Any]:
        if set(self.labels) <= {"seed"}:
            return {"run": self.name, **self.labels}
        return dict(self.labels)


@dataclass(frozen=True)
class ImportResult:
    sweep: str
    compute_axis: str
    num_runs: int
    num_points: int
    new_runs: int
    created_sweep: bool


def run_id(sweep: str, name: str) -> str:
    """The imported run's id: stable across imports of the same run into the same sweep."""
    return hashlib.sha256(f"import\n{sweep}\n{name}".encode()).hexdigest()[:12]


def import_curves(
    store: Store, path: Path, sweep: str, *, compute_axis: str = "gpu_hours", fmt: str | None = None
) -> ImportResult:
    """Validate the whole file, then write its runs and points into `sweep` (created if new)."""
    if compute_axis not in MEASURED_COMPUTE_AXES:
        raise ValueError(f"compute axis must be one of {', '.join(MEASURED_COMPUTE_AXES)}, got {compute_axis!r}")
    if not NAME_RE.match(sweep):
        raise ValueError(
            f"invalid sweep name {sweep!r}: 1-64 characters of letters, digits, '.', '_', '-', "
            "not starting with '.', '_' or '-'"
        )
    runs = parse_rows(path, read_rows(path, fmt or detect_format(path)), compute_axis)
    _check_against_store(store, path, sweep, runs)
    return _write(store, path, sweep, compute_axis, runs)


# ---------------------------------------------------------------------------------------------
# Reading


def detect_format(path: Path) -> str:
    fmt = _EXTENSIONS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(
            f"cannot tell the format of {path} from its extension ({', '.join(_EXTENSIONS)}); "
            f"give --format {'|'.join(IMPORT_FORMATS)}"
        )
    return fmt


def read_rows(path: Path, fmt: str) -> list[Row]:
    """Every data row of the file, with its line number; unreadable rows are errors."""
    if fmt not in IMPORT_FORMATS:
        raise ValueError(f"format must be one of {', '.join(IMPORT_FORMATS)}, got {fmt!r}")
    rows: list[Row] = []
    errors: list[str] = []
    reader = _csv_rows if fmt == "csv" else _jsonl_rows
    for line, fields, error in reader(path, _text(path)):
        if error:
            errors.append(f"{path}:{line}: {error}")
        else:
            rows.append(Row(line, fields))
    if errors:
        raise ImportFileError(path, errors)
    if not rows:
        raise ImportFileError(path, [f"{path}: no rows"])
    return rows


def _text(path: Path) -> str:
    """The file's text (UTF-8, with or without a byte-order mark); other bytes are an error that
    names the file and the line."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ImportFileError(
            path, [f"{path}:{line}: byte {data[exc.start]:#04x} is not UTF-8; save the file as UTF-8"]
        ) from None


def _csv_rows(path: Path, text: str) -> Iterator[tuple[int, dict[str, Any], str | None]]:
    """(line, fields, error) per data row; the line is where the row ends (csv's line_num)."""
    with io.StringIO(text, newline="") as handle:
        reader = csv.reader(handle)
        header = [name.strip() for name in next(reader, [])]
        problem = _header_problem(header)
        if problem:
            yield 1, {}, problem
            return
        for cells in reader:
            if not any(cell.strip() for cell in cells):
                continue
            if len(cells) != len(header):
                yield reader.line_num, {}, f"{len(cells)} fields, but the header has {len(header)}"
                continue
            yield reader.line_num, {k: v.strip() for k, v in zip(header, cells) if v.strip()}, None


def _header_problem(header: list[str]) -> str | None:
    missing = [name for name in REQUIRED if name not in header]
    if missing:
        return f"missing column {', '.join(map(repr, missing))} (the header has: {', '.join(header) or 'nothing'})"
    repeated = sorted({name for name in header if header.count(name) > 1})
    if repeated:
        return f"column {', '.join(map(repr, repeated))} appears more than once"
    if "" in header:
        return f"column {header.index('') + 1} has no name"
    return None


def _jsonl_rows(path: Path, text: str) -> Iterator[tuple[int, dict[str, Any], str | None]]:
    for line, row in enumerate(text.splitlines(), start=1):
        if not row.strip():
            continue
        try:
            value = json.loads(row.rstrip())
        except json.JSONDecodeError as exc:
            yield line, {}, f"not valid JSON ({exc.msg}, column {exc.colno})"
            continue
        except ValueError as exc:  # an integer literal of more than 4,300 digits
            yield line, {}, f"not importable JSON: {str(exc).split(';')[0]}"
            continue
        if not isinstance(value, dict):
            yield line, {}, f"expected a JSON object, got {type(value).__name__}"
            continue
        blank = [k for k in value if not k.strip()]
        if blank:
            yield line, {}, f"a key is {blank[0]!r}: every label needs a name"
            continue
        yield line, {k: v for k, v in value.items() if not _blank(v)}, None


def _blank(value: Any) -> bool:
    """null, "" and whitespace say nothing, in JSONL as in an empty CSV cell."""
    return value is None or (isinstance(value, str) and not value.strip())


# ---------------------------------------------------------------------------------------------
# Validating


def parse_rows(path: Path, rows: Sequence[Row], compute_axis: str) -> list[ImportedRun]:
    """Group rows into runs, checking every value; all errors at once, each naming its line."""
    runs: dict[str, ImportedRun] = {}
    errors: list[tuple[int, str]] = []
    for row in rows:
        try:
            _add_row(runs, row, compute_axis)
        except ValueError as exc:
            errors.append((row.line, str(exc)))
    for run in runs.values():
        if run.step_lines and run.stepless_line is not None:
            errors.append((
                run.stepless_line,
                f"no step, but run {run.name!r} gives steps on other rows (line {min(run.step_lines.values())}); "
                "give steps on all of a run's rows or on none",
            ))  # fmt: skip
    if errors:
        raise ImportFileError(path, [f"{path}:{line}: {message}" for line, message in sorted(errors)])
    for run in runs.values():
        if not run.step_lines:
            for i, point in enumerate(run.points):
                point["step"] = i
    return list(runs.values())


def _add_row(runs: dict[str, ImportedRun], row: Row, compute_axis: str) -> None:
    fields = row.fields
    missing = [name for name in REQUIRED if name not in fields]
    if missing:
        raise ValueError(f"missing {', '.join(map(repr, missing))}")
    name = str(fields["run"]).strip()
    compute = _number(fields["compute"], "compute")
    if compute < 0:
        raise ValueError(f"compute {fields['compute']!r} is negative")
    pass_rate = _number(fields["pass_rate"], "pass_rate")
    if not 0 <= pass_rate <= 1:
        raise ValueError(f"pass_rate {fields['pass_rate']!r} is outside [0, 1]")
    step = _step(fields["step"]) if "step" in fields else None
    labels = {k: _label(k, v) for k, v in fields.items() if k not in RESERVED}
    run = runs.setdefault(name, ImportedRun(name, row.line))
    if step in run.step_lines:
        raise ValueError(f"run {name!r} has step {step} twice (also on line {run.step_lines[step]})")
    _merge_labels(run, labels, row.line)
    point = _point(compute, pass_rate, compute_axis)
    if step is None:
        run.stepless_line = run.stepless_line or row.line
    else:
        run.step_lines[step] = row.line
        point["step"] = step
    run.points.append(point)


def _merge_labels(run: ImportedRun, labels: dict[str, Any], line: int) -> None:
    for key, value in labels.items():
        if key in run.labels and run.labels[key] != value:
            raise ValueError(
                f"label {key!r} of run {run.name!r} is {value!r} here but {run.labels[key]!r} on line "
                f"{run.label_lines[key]}; labels must be constant within a run (drop a column that is a metric)"
            )
        run.labels.setdefault(key, value)
        run.label_lines.setdefault(key, line)


def _point(compute: float, pass_rate: float, compute_axis: str) -> dict[str, Any]:
    point: dict[str, Any] = {
        "pass_rate": pass_rate, "flops": 0.0, "tokens": 0, "device_seconds": 0.0, "gpu_hours": 0.0, "num_samples": 0,
    }  # fmt: skip
    point[compute_axis] = round(compute) if compute_axis == "tokens" else compute
    return point


def _number(value: Any, name: str) -> float:
    """A finite float from a JSON number or a numeric string (exports often quote numbers)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{name} {value!r} is not a number")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{name} {_short(value)} is not a number") from None
    except OverflowError:  # an integer beyond a float's range (JSON's 10**400)
        raise ValueError(f"{name} {_short(value)} is too large (at most {sys.float_info.max:.3g})") from None
    if not math.isfinite(number):
        digits = isinstance(value, str) and value.strip().lstrip("+-").isdigit()
        raise ValueError(f"{name} {_short(value)} is {'too large' if digits else 'not a finite number'}")
    return number


def _short(value: Any) -> str:
    """A value for an error line: a huge number as its first digits and its length."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else f"{str(value)[:12]}... ({len(str(value))} digits)"
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


MAX_STEP = 2**31 - 1
"""The store's step column is a 32-bit integer (PostgreSQL's INTEGER)."""


def _step(value: Any) -> int:
    number = _number(value, "step")
    if number != int(number) or not 0 <= number <= MAX_STEP:
        raise ValueError(f"step {value!r} is not an integer in [0, {MAX_STEP}]")
    return int(number)


def _label(key: str, value: Any) -> Any:
    """A label's value: JSON scalars as they are; CSV text as int or float when it reads as one."""
    if isinstance(value, list | dict):
        raise ValueError(f"label {key!r} is a {type(value).__name__}; labels are single values")
    if key == "seed":
        number = _number(value, "seed")
        if number != int(number) or not 0 <= number <= 2**32 - 1:
            raise ValueError(f"seed {value!r} is not an integer in [0, {2**32 - 1}]")
        return int(number)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"label {key!r} is {value!r}, not a finite number")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**53:
        raise ValueError(f"label {key!r} is {_short(value)}: integers up to 2^53 only")
    if isinstance(value, str):
        if value.strip().lower() in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity"):
            raise ValueError(f"label {key!r} is {value!r}, not a finite number")
        for kind in (int, float):
            try:
                number = kind(value)
            except ValueError:
                if kind is int and value.strip().lstrip("+-").isdigit():  # more digits than int() reads
                    raise ValueError(f"label {key!r} is {_short(value)}: integers up to 2^53 only") from None
                continue
            if kind is int and abs(number) > 2**53:
                raise ValueError(f"label {key!r} is {_short(value)}: integers up to 2^53 only")
            if not math.isfinite(number):  # 1e999 reads as inf: never stored (JSON has no inf)
                raise ValueError(f"label {key!r} is {_short(value)}, beyond a float's range")
            return number
    return value


# ---------------------------------------------------------------------------------------------
# Writing


def _check_against_store(store: Store, path: Path, sweep: str, runs: Sequence[ImportedRun]) -> None:
    """A run imported before with other labels would keep its old axes (runs are never
    rewritten), and its report would silently disagree with the file: refuse instead."""
    if store.get_sweep(sweep) is None:
        return
    existing = {r.id: r for r in store.runs(sweep)}
    errors = [
        f"{path}:{run.first_line}: run {run.name!r} was imported into {sweep!r} before with labels "
        f"{existing[run.id(sweep)].axes}, now {run.axes}; import it into a new sweep or under a new name"
        for run in runs
        if run.id(sweep) in existing and existing[run.id(sweep)].axes != run.axes
    ]
    if errors:
        raise ImportFileError(path, errors)


def _write(store: Store, path: Path, sweep: str, compute_axis: str, runs: Sequence[ImportedRun]) -> ImportResult:
    """Everything in one store transaction (`Store.import_runs`): an error leaves nothing behind."""
    created, new = store.import_runs(
        sweep,
        {"name": sweep, "imported_from": str(path)},
        [(_new_run(path, sweep, run, i), run.points) for i, run in enumerate(runs)],
        executor=EXECUTOR,
        reason=f"imported from {path.name}",
    )
    return ImportResult(
        sweep=sweep,
        compute_axis=compute_axis,
        num_runs=len(runs),
        num_points=sum(len(r.points) for r in runs),
        new_runs=len(new),
        created_sweep=created,
    )


def _new_run(path: Path, sweep: str, run: ImportedRun, position: int) -> NewRun:
    config = {"source": EXECUTOR, "file": path.name, "run": run.name}
    return NewRun(run.id(sweep), position, config, run.axes, {}, run_dir="")
