"""The recipe's configuration: one validated, torch-free dataclass tree.

Every ScaleRL knob (README, "The recipe") is one field. Defaults are the paper's, except where a
field names the built-in CPU task and model, which is what runs when nothing else is given.

The launcher imports this module to validate grids on a login node, so torch, vllm and
deepspeed must never be imported here. It also owns the files that hand a run from the launcher
to the recipe (see `write_run_files`).

Dotted keys (`loss.aggregation`) address fields; `async` is spelled `async_` in Python.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A key or value that the recipe does not accept.

    The message names the key, the bad value, what is allowed and the closest match.
    """

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.detail = message


class NotAvailableError(RuntimeError):
    """A knob value that is validated but not implemented by this engine yet."""


# ---------------------------------------------------------------------------------------------
# The tree


@dataclass(frozen=True)
class Range:
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself is not allowed

    def check(self, key: str, value: float | None) -> None:
        if value is None:
            return
        if self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            bound = f"> {self.lo}" if self.lo_open else f">= {self.lo}"
            raise ConfigError(
                key, f"invalid value {value!r}; must be {bound}" + (f" and <= {self.hi}" if self.hi is not None else "")
            )
        if self.hi is not None and value > self.hi:
            raise ConfigError(key, f"invalid value {value!r}; must be <= {self.hi}")


def bounded(default: Any, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> Any:
    """A numeric field with an allowed range, checked on construction and by `check_value`."""
    return field(default=default, metadata={"range": Range(lo, hi, lo_open)})


@dataclass(kw_only=True)
class Section:
    """A config section: checks its fields' ranges, then its cross-field rules (`check`)."""

    KEY: typing.ClassVar[str] = ""

    def __post_init__(self) -> None:
        for name, key, allowed, bounds in _field_checks(type(self)):
            value = getattr(self, name)
            if allowed is not None and value not in allowed:
                raise ConfigError(key, f"invalid value {value!r}; allowed: {', '.join(map(repr, allowed))}")
            if bounds is not None:
                bounds.check(key, value)
        self.check()

    def check(self) -> None:
        """Rules that involve several fields."""


@dataclass(kw_only=True)
class ModelConfig(Section):
    KEY = "model"
    path: str = "builtin:sort6-tiny"
    """A Hugging Face model directory, or `builtin:sort6-tiny` (generated locally, no download)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The body's dtype on the trainer and every generator alike (`resolve_dtype`): auto is
    bfloat16 on GPU, float32 on CPU. A bfloat16 body trains with fp32 master weights and fp32
    optimizer state on every trainer (docs/engines.md, "Precision")."""


MODEL_DTYPES = ("float32", "bfloat16")
"""What `model.dtype` resolves to."""


def resolve_dtype(name: str, *, gpu: bool) -> str:
    """`model.dtype` for a job on a GPU (`gpu`) or on CPU: the one place `auto` is decided, for the
    trainer, every generator (torch or vLLM) and `sweep launch`'s checks alike, so the two sides
    of a run never differ. auto: bfloat16 on a GPU (trained as mixed precision: fp32 master
    weights and optimizer state), float32 on CPU (where bfloat16 is no faster for the small models)."""
    if name == "auto":
        return "bfloat16" if gpu else "float32"
    if name not in MODEL_DTYPES:
        allowed = ", ".join(map(repr, ("auto", *MODEL_DTYPES)))
        raise ConfigError("model.dtype", f"invalid value {name!r}; allowed: {allowed}")
    return name


SUMK_DIGITS = (1, 12)
"""The k a sumk prompt may have (recipe.tasks.sumk.MIN_DIGITS, MAX_DIGITS; a test keeps them equal)."""
SORT6_MAX_NEW_TOKENS = 7
"""sort6's own generation cap (six digits and EOS): the task has no thinking phase."""
SUMK_ANSWER_TOKENS = 4
"""sumk's new tokens beyond its scratchpad (a running sum per digit): `</think>`, two answer digits, EOS."""
BUILTIN_MODEL_TASKS = {"builtin:sort6-tiny": "sort6", "builtin:sumk-tiny": "sumk", "builtin:sumk-small": "sumk"}
"""The task each built-in base model was warmed up on (its tokenizer knows that task's symbols only)."""


@dataclass(kw_only=True)
class DataConfig(Section):
    KEY = "data"
    task: Literal["sort6", "sumk", "math-jsonl"] = "sort6"
    """sort6: the built-in task (sort the 6 digits of two 3-digit numbers). sumk: the built-in
    thinking task (the sum mod 10 of k digits, worked out in a scratchpad; model builtin:sumk-tiny).
    math-jsonl: files below."""
    train: str = ""
    valid: str = ""
    num_train_prompts: int = bounded(20000, lo=1)
    num_valid_prompts: int = bounded(256, lo=1)
    sumk_min_digits: int = bounded(2, lo=SUMK_DIGITS[0], hi=SUMK_DIGITS[1])
    sumk_max_digits: int = bounded(12, lo=SUMK_DIGITS[0], hi=SUMK_DIGITS[1])
    """sumk: k is uniform on [sumk_min_digits, sumk_max_digits]; a k-digit problem takes k + 4 new tokens."""

    def check(self) -> None:
        if self.task == "math-jsonl" and not (self.train and self.valid):
            raise ConfigError("data.train", "math-jsonl needs data.train and data.valid (JSONL paths)")
        if self.sumk_max_digits < self.sumk_min_digits:
            raise ConfigError(
                "data.sumk_max_digits", f"{self.sumk_max_digits} is below data.sumk_min_digits={self.sumk_min_digits}"
            )
        if self.task != "sumk":
            for key in ("sumk_min_digits", "sumk_max_digits"):
                if getattr(self, key) != getattr(DataConfig, key):
                    raise ConfigError(f"data.{key}", f"applies to data.task=sumk only, not {self.task!r}")

    def same_files(self) -> bool:
        """Whether data.valid is data.train (math-jsonl): then the held-out rows come out of it."""
        return bool(self.train) and Path(self.train).expanduser().resolve() == Path(self.valid).expanduser().resolve()

    def check_split(self, num_rows: int) -> None:
        """With data.valid the same file as data.train, its `num_rows` rows must leave some to
        train on after data.num_valid_prompts held-out ones (`sweep launch` and the job check it)."""
        if self.same_files() and num_rows <= self.num_valid_prompts:
            raise ConfigError(
                "data.num_valid_prompts",
                f"{self.num_valid_prompts} held-out rows leave none of the {num_rows} rows of "
                f"{self.train} to train on; lower data.num_valid_prompts or give a separate data.valid",
            )


@dataclass(kw_only=True)
class AsyncConfig(Section):
    KEY = "async"
    mode: Literal["pipeline", "ppo-offpolicy"] = "pipeline"
    """pipeline: PipelineRL-k. ppo-offpolicy: generate k batches with one policy, then k steps."""
    max_lag: int = bounded(8, lo=1)
    """k: the oldest policy version a trainer step may use (pipeline), or batches per policy."""


@dataclass(kw_only=True)
class LossConfig(Section):
    KEY = "loss"
    type: Literal["cispo", "dapo", "gspo", "grpo"] = "cispo"
    aggregation: Literal["prompt", "sample", "token"] = "prompt"
    eps_max: float = bounded(5.0, lo=1.0)
    """CISPO: the importance ratio is capped at this absolute value (TRL's convention)."""
    clip_low: float = bounded(0.2, lo=0.0, hi=1.0)
    """DAPO and GRPO: ratio clipped below at 1 - clip_low (GRPO clips symmetrically)."""
    clip_high: float = bounded(0.28, lo=0.0, hi=1.0)
    """DAPO: ratio clipped above at 1 + clip_high."""
    gspo_clip_low: float = bounded(3e-3, lo=0.0, hi=1.0)
    gspo_clip_high: float = bounded(5e-3, lo=0.0, hi=1.0)


@dataclass(kw_only=True)
class AdvantageConfig(Section):
    KEY = "advantage"
    norm: Literal["batch", "prompt", "none"] = "batch"
    """A = r - mean(group r), divided by the std of the batch's / the group's advantages, or not."""


@dataclass(kw_only=True)
class PrecisionConfig(Section):
    KEY = "precision"
    lm_head_fp32: bool = True


@dataclass(kw_only=True)
class FilterConfig(Section):
    KEY = "filter"
    zero_variance: bool = True
    """Drop groups whose rewards are all equal from the loss (no refill)."""
    no_positive_resampling: bool = True
    """A prompt whose pass rate reaches `npr_threshold` leaves the training set for good."""
    npr_threshold: float = bounded(0.9, lo=0.0, hi=1.0)
    damp_below: float = bounded(0.25, lo=0.0, hi=1.0)
    """With `zero_variance`: a step whose kept groups are fewer than this share of the batch's
    groups takes a proportionally smaller lr (lr x kept / (damp_below x groups)); 0 turns it off."""


@dataclass(kw_only=True)
class LengthConfig(Section):
    KEY = "length"
    control: Literal["interrupt", "penalty", "none"] = "interrupt"
    max_new_tokens: int = bounded(14336, lo=1)
    """Generation cap; a task with shorter answers (sort6: 7 tokens) uses its own, smaller cap."""
    interrupt_min: int = bounded(10240, lo=1)
    interrupt_max: int = bounded(12288, lo=1)
    """interrupt: thinking budget drawn from [interrupt_min, interrupt_max] tokens."""
    penalty_max: int = bounded(14336, lo=1)
    penalty_cache: int = bounded(2048, lo=1)
    """penalty (DAPO): clip((penalty_max - |y|) / penalty_cache - 1, -1, 0) added to the reward."""

    def check(self) -> None:
        if self.interrupt_max < self.interrupt_min:
            raise ConfigError(
                "length.interrupt_max",
                f"{self.interrupt_max} is below length.interrupt_min={self.interrupt_min}",
            )


@dataclass(kw_only=True)
class BatchConfig(Section):
    KEY = "batch"
    prompts: int = bounded(48, lo=1)
    generations: int = bounded(16, lo=2)


@dataclass(kw_only=True)
class OptimConfig(Section):
    KEY = "optim"
    lr: float = bounded(5e-7, lo=0.0, lo_open=True)
    warmup_steps: int = bounded(100, lo=0)
    weight_decay: float = bounded(0.01, lo=0.0)
    eps: float = bounded(1e-15, lo=0.0, lo_open=True)
    beta1: float = bounded(0.9, lo=0.0, hi=1.0)
    beta2: float = bounded(0.999, lo=0.0, hi=1.0)
    max_grad_norm: float = bounded(1.0, lo=0.0)
    """0 disables gradient clipping."""


@dataclass(kw_only=True)
class EvalConfig(Section):
    KEY = "eval"
    every: int = bounded(100, lo=1)
    samples: int = bounded(16, lo=1)
    """k of mean@k: samples per held-out prompt."""
    log_spaced: bool = True
    """Also evaluate at steps 0, 1, 2, 4, 8, ... below `every`, where the curve moves fastest."""
    early_every: int | None = bounded(None, lo=1)
    """Evaluate every `early_every` steps before step `early_until` (denser points where the curve
    climbs, so that a fit from the first quarter of a run has enough of them); None: off."""
    early_until: int = bounded(0, lo=0)

    def check(self) -> None:
        if self.early_every is not None and self.early_until == 0:
            raise ConfigError("eval.early_until", "must be > 0 when eval.early_every is set")

    def evaluates(self, step: int) -> bool:
        """Whether the loop evaluates after `step` (it also evaluates at the last step).

        Step 0, multiples of `every`, multiples of `early_every` below `early_until`, and powers of
        two below `every` if `log_spaced`.
        """
        if step % self.every == 0:
            return True
        if self.early_every is not None and step < self.early_until and step % self.early_every == 0:
            return True
        return self.log_spaced and step < self.every and step & (step - 1) == 0


@dataclass(kw_only=True)
class CheckpointConfig(Section):
    KEY = "checkpoint"
    every: int = bounded(100, lo=1)
    keep: int = bounded(2, lo=1)
    """How many of the newest checkpoints to keep; older ones are deleted."""


@dataclass(kw_only=True)
class BudgetConfig(Section):
    """When a run stops: the first of the limits that are set."""

    KEY = "budget"
    steps: int | None = bounded(None, lo=1)
    gpu_hours: float | None = bounded(None, lo=0.0, lo_open=True)
    flops: float | None = bounded(None, lo=0.0, lo_open=True)

    def check(self) -> None:
        if self.steps is None and self.gpu_hours is None and self.flops is None:
            raise ConfigError("budget", "set at least one of budget.steps, budget.gpu_hours, budget.flops")


@dataclass(kw_only=True)
class EngineConfig(Section):
    KEY = "engine"
    generator: Literal["auto", "torch", "vllm"] = "auto"
    """auto: vllm on GPU, a plain torch sampler on CPU."""
    trainer: Literal["auto", "torch", "deepspeed"] = "auto"
    """auto: deepspeed on GPU, plain torch on CPU."""
    threads: int = bounded(1, lo=1)
    """CPU threads for torch when no GPU is used."""
    generator_ranks: int = bounded(0, lo=0, hi=4096)
    """How many of the run's job tasks generate (the rest train). 0: one task that alternates
    generation and training, so `async.mode=pipeline` runs synchronously (lag 0)."""
    gpu_memory_utilization: float | None = bounded(None, lo=0.0, hi=1.0, lo_open=True)
    """The share of its GPU's memory a vLLM engine takes (weights, activations, KV cache): vLLM's
    own `gpu_memory_utilization`. None: 0.85 on a GPU of its own (a generator rank), 0.3 where it
    shares the GPU with the trainer (`generator_ranks: 0`, vLLM colocated, as TRL's colocate mode)."""
    zero_stage: Literal[0, 1, 2] = 2
    """DeepSpeed's ZeRO stage (engine.trainer=deepspeed): 0 plain data parallel, 1 optimizer
    state, 2 + gradients sharded over the trainer ranks. Not 3: it shards the weights, which
    trainer rank 0 samples, evaluates and pushes with whole."""
    peer_timeout_s: float = bounded(1800.0, lo=1.0, hi=7 * 86400.0)
    """Seconds one task of a multi-task run waits for another before it fails the attempt naming
    whom it waited for: joining the groups, a weight push, trainer rank 0 waiting for rollouts, a
    generator waiting for its next command. Longer than trainer rank 0's longest silence in a
    healthy run (its evaluation and checkpoint); docs/multinode.md."""
    kernels: Literal["reference", "fast", "compiled"] = "reference"
    """reference: the trainer's pass is transformers' Llama forward and the update torch's AdamW,
    bit for bit. fast (the torch trainer): each prompt's positions computed once for its group in
    the trainer's pass, and the fused AdamW: the same math, rounded differently (docs/decisions.md).
    compiled: fast, with that pass and the training batches' decode steps through torch.compile
    (recipe/model/compiled.py): a compile of ~30 s per process on the built-in models, and once more on
    the first batch of a new shape; for long runs. The DeepSpeed trainer computes as reference
    whatever the value."""

    def vllm_memory_share(self, *, shares_gpu: bool) -> float:
        """`gpu_memory_utilization` resolved for an engine that shares its GPU with a trainer or not."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return 0.3 if shares_gpu else 0.85


@dataclass(kw_only=True)
class RecipeConfig(Section):
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)
    length: LengthConfig = field(default_factory=LengthConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    budget: BudgetConfig = field(default_factory=lambda: BudgetConfig(steps=1000))
    engine: EngineConfig = field(default_factory=EngineConfig)
    seed: int = bounded(0, lo=0, hi=2**32 - 1)
    """torch, numpy and vLLM all take 32-bit seeds."""

    def check(self) -> None:
        check_task_rules(self)

    # -- conversions -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict with the YAML spelling of keys (`async`, not `async_`)."""
        return _to_dict(self)

    def canonical_json(self) -> str:
        """The resolved config as JSON with sorted keys: the input of run ids."""
        return canonical_json(self.to_dict())

    @classmethod
    def from_dict(cls, nested: dict[str, Any]) -> RecipeConfig:
        """Validate and build from a nested dict of YAML keys; unset keys keep defaults."""
        return resolve(flatten(nested))

    def get(self, key: str) -> Any:
        node: Any = self
        for part in key.split("."):
            node = getattr(node, _attr(part))
        return node


def check_task_rules(cfg: RecipeConfig) -> None:
    """Rules between the task, the model and length control that need no model or data:
    a built-in model serves its own task only; under `length.control=interrupt` a sumk budget that
    can be reached leaves room for the answer (the interrupt appends `</think>`, then the two answer
    digits and EOS must still fit under the generation cap)."""
    task, path = cfg.data.task, cfg.model.path
    trained_on = BUILTIN_MODEL_TASKS.get(path)
    if trained_on is not None and trained_on != task:
        fitting = ", ".join(p for p, t in BUILTIN_MODEL_TASKS.items() if t == task) or "a Hugging Face model directory"
        raise ConfigError(
            "model.path", f"{path!r} is the {trained_on} base model; data.task={task!r} needs {fitting}"
        )
    length = cfg.length
    if task == "sumk" and length.control == "interrupt":
        cap = min(cfg.data.sumk_max_digits + SUMK_ANSWER_TOKENS, length.max_new_tokens)
        room = cap - SUMK_ANSWER_TOKENS
        if length.interrupt_min < cap and length.interrupt_max > room:
            raise ConfigError(
                "length.interrupt_max",
                f"{length.interrupt_max}: an interrupt at that thinking budget leaves no room for the answer under "
                f"the generation cap of {cap} tokens (`</think>`, the answer and EOS take {SUMK_ANSWER_TOKENS}); "
                f"lower it to <= {room} or raise length.max_new_tokens",
            )


# ---------------------------------------------------------------------------------------------
# Schema: what the grid validator checks keys and values against


@dataclass(frozen=True)
class FieldSpec:
    key: str
    type: Any
    default: Any
    allowed: tuple[Any, ...] | None  # the values of a Literal, else None
    range: Range | None

    def describe(self) -> str:
        if self.allowed is not None:
            return "one of " + ", ".join(repr(v) for v in self.allowed)
        return _type_name(self.type)


def _build_schema(cls: type, prefix: str = "") -> dict[str, FieldSpec]:
    out: dict[str, FieldSpec] = {}
    hints = _hints(cls)
    defaults = cls() if cls is not BudgetConfig else BudgetConfig(steps=1000)
    for f in dataclasses.fields(cls):
        key = prefix + _key(f.name)
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out.update(_build_schema(tp, key + "."))
            continue
        allowed = typing.get_args(tp) if typing.get_origin(tp) is Literal else None
        out[key] = FieldSpec(key, tp, getattr(defaults, f.name), allowed, f.metadata.get("range"))
    return out


def check_value(key: str, value: Any) -> Any:
    """Check one dotted key and value against the schema; return the value, coerced (int -> float).

    Raises ConfigError naming the key, the value, what is allowed and the closest match.
    """
    spec = _SCHEMA.get(key)
    if spec is None:
        raise ConfigError(key, unknown_key_message(key, _SCHEMA))
    if spec.allowed is not None:
        if value not in spec.allowed or isinstance(value, bool) != isinstance(spec.allowed[0], bool):
            hint = closest(str(value), [str(v) for v in spec.allowed])
            raise ConfigError(
                key,
                f"invalid value {value!r}; allowed: {spec.describe()}" + (f" (did you mean {hint!r}?)" if hint else ""),
            )
        return value
    coerced = _coerce(spec.type, value)
    if coerced is _INVALID:
        raise ConfigError(key, f"invalid value {value!r}; expected {spec.describe()}")
    if isinstance(coerced, float) and not math.isfinite(coerced):
        raise ConfigError(key, f"invalid value {value!r}; expected a finite number")
    if spec.range is not None:
        spec.range.check(key, coerced)
    if isinstance(coerced, int) and abs(coerced) > MAX_INT:
        raise ConfigError(key, f"invalid value {value!r}; must be <= {MAX_INT} (2^53)")
    return coerced


def resolve(flat: dict[str, Any]) -> RecipeConfig:
    """Defaults + dotted overrides -> a validated RecipeConfig."""
    nested = copy.deepcopy(_DEFAULTS)
    for key, value in flat.items():
        checked = check_value(key, value)
        parts = key.split(".")
        node = nested
        for part in parts[:-1]:
            node = node[part]
        node[parts[-1]] = checked
    try:
        return _build(RecipeConfig, nested)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:  # pragma: no cover - the schema check catches these
        raise ConfigError("recipe", str(exc)) from exc


def canonical_json(nested: dict[str, Any]) -> str:
    return json.dumps(nested, sort_keys=True, separators=(",", ":"))


def unknown_key_message(key: str, known: typing.Iterable[str]) -> str:
    known = sorted(known)
    hint = closest(key, known)
    msg = f"unknown key {key!r}"
    if hint:
        msg += f" (did you mean {hint!r}?)"
    section = key.split(".")[0]
    siblings = [k for k in known if k.split(".")[0] == section]
    return msg + "; allowed keys: " + ", ".join(siblings or known)


def closest(word: str, candidates: typing.Iterable[str]) -> str | None:
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def flatten(nested: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'loss': {'type': 'cispo'}} -> {'loss.type': 'cispo'}; leaves that are lists stay lists."""
    out: dict[str, Any] = {}
    for key, value in nested.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


# ---------------------------------------------------------------------------------------------
# Experiment trackers: a sweep file's top-level `tracking:` block (not part of a run's config, so
# turning a tracker on changes no run id); recipe/telemetry/trackers.py mirrors each run to them.

TRACKING_KEYS = ("wandb", "tensorboard")
WANDB_KEYS = ("project", "entity", "mode")
WANDB_MODES = ("online", "offline")


def tracking_block(raw: Any) -> dict[str, Any]:
    """The `tracking:` block, checked and filled in: {"wandb": {project, entity, mode} or None,
    "tensorboard": bool}. `wandb: true` takes the defaults (project scalesweep, online)."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError("tracking", f"{raw!r} must be a mapping with keys {', '.join(TRACKING_KEYS)}")
    _known("tracking", raw, TRACKING_KEYS)
    wandb = raw.get("wandb") or None
    if wandb is True:
        wandb = {}
    if wandb is not None:
        if not isinstance(wandb, dict):
            raise ConfigError("tracking.wandb", f"{wandb!r} must be true, false or a mapping with keys {', '.join(WANDB_KEYS)}")
        _known("tracking.wandb", wandb, WANDB_KEYS)
        for key in ("project", "entity"):
            if wandb.get(key) is not None and not (isinstance(wandb[key], str) and wandb[key].strip()):
                raise ConfigError(f"tracking.wandb.{key}", f"{wandb[key]!r} must be a non-empty string")
        mode = wandb.get("mode", "online")
        if mode not in WANDB_MODES:
            raise ConfigError("tracking.wandb.mode", f"invalid value {mode!r}; allowed: {', '.join(WANDB_MODES)}")
        wandb = {"project": wandb.get("project") or "scalesweep", "entity": wandb.get("entity"), "mode": mode}
    tensorboard = raw.get("tensorboard", False)
    if not isinstance(tensorboard, bool):
        raise ConfigError("tracking.tensorboard", f"invalid value {tensorboard!r}; allowed: true, false")
    return {"wandb": wandb, "tensorboard": tensorboard}


def _known(where: str, mapping: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for key in mapping:
        if key not in allowed:
            hint = closest(str(key), allowed)
            raise ConfigError(
                f"{where}.{key}", f"unknown key{f' (did you mean {hint!r}?)' if hint else ''}; allowed: {', '.join(allowed)}"
            )


# ---------------------------------------------------------------------------------------------
# Run directories: the launcher writes them, `python -m recipe RUN_DIR` reads them.
#
# RUN_DIR/config.yaml   the resolved RecipeConfig
# RUN_DIR/run.json      run id, sweep and database URL (mode 0600: the URL may hold a password)
# RUN_DIR/logs/         one stdout/stderr pair per attempt
# RUN_DIR/checkpoints/  written by the recipe


def cache_root() -> Path:
    """`$SWEEP_CACHE` (default `~/.cache/scalesweep`): built-in models, scheduler locks."""
    return Path(os.environ.get("SWEEP_CACHE") or Path.home() / ".cache" / "scalesweep")


CONFIG_FILE = "config.yaml"
RUN_FILE = "run.json"


def write_run_files(
    run_dir: str | Path,
    *,
    run_id: str,
    sweep: str,
    db_url: str,
    config: RecipeConfig | dict[str, Any],
    sweep_file: str | None = None,
    sweep_file_sha256: str | None = None,
) -> Path:
    """Create or refresh a run directory; checkpoints and logs already there are kept. `config`
    may be given as its `to_dict()` when the caller has it already."""
    run_dir = Path(run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    header = f"# scalesweep run {run_id} of sweep {sweep}: the resolved recipe config\n"
    _atomic_write(run_dir / CONFIG_FILE, header + config_yaml(config if isinstance(config, dict) else config.to_dict()), mode=0o644)
    info = {
        "run_id": run_id, "sweep": sweep, "db_url": db_url, "sweep_file": sweep_file, "sweep_file_sha256": sweep_file_sha256,
    }  # fmt: skip
    _atomic_write(run_dir / RUN_FILE, json.dumps(info, indent=2) + "\n", mode=0o600)
    return run_dir


_SECTION_YAML: dict[tuple[str, str], str] = {}
_SECTION_YAML_MAX = 4096


def config_yaml(config: dict[str, Any]) -> str:
    """`config` as block YAML, exactly what `yaml.dump(config, sort_keys=False)` writes.

    A block mapping's text is its entries' texts one after the other, so each top-level section
    is rendered on its own and kept by its value's repr: a grid's runs differ in a few sections,
    and PyYAML's representer (~250 us a config) was most of the cost of registering 10,000 runs.
    repr, unlike JSON, tells 1 from True and "1" from 1. PyYAML (OmegaConf's own dependency) is
    100x faster than OmegaConf.to_yaml.
    """
    import yaml

    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    parts = []
    for key, value in config.items():
        memo = (key, repr(value))
        text = _SECTION_YAML.get(memo)
        if text is None:
            text = yaml.dump({key: value}, Dumper=dumper, sort_keys=False)
            if len(_SECTION_YAML) < _SECTION_YAML_MAX:
                _SECTION_YAML[memo] = text
        parts.append(text)
    return "".join(parts)


def read_run_files(run_dir: str | Path) -> tuple[dict[str, Any], RecipeConfig]:
    """(the contents of run.json, the validated config)."""
    from omegaconf import OmegaConf

    run_dir = Path(run_dir)
    info = json.loads((run_dir / RUN_FILE).read_text())
    nested = OmegaConf.to_container(OmegaConf.load(run_dir / CONFIG_FILE), resolve=True)
    if not isinstance(nested, dict):
        raise ConfigError(str(run_dir / CONFIG_FILE), "the file must hold a mapping")
    return info, RecipeConfig.from_dict({str(k): v for k, v in nested.items()})


def _atomic_write(path: Path, text: str, *, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Helpers

_INVALID = object()
MAX_INT = 2**53
"""Integers a sweep file may hold: beyond this a YAML/JSON round trip through a float loses them."""


def _key(attr: str) -> str:
    return attr.rstrip("_")


def _attr(key: str) -> str:
    return "async_" if key == "async" else key


def _to_dict(obj: Any) -> Any:
    names = _field_names(type(obj))
    if names is None:
        return obj
    return {key: _to_dict(getattr(obj, attr)) for attr, key in names}


_FIELD_NAMES: dict[type, tuple[tuple[str, str], ...] | None] = {}


def _field_names(cls: type) -> tuple[tuple[str, str], ...] | None:
    """(attribute, key) of each field of a config dataclass, None for any other type: looked up
    once per class (dataclasses.fields per call was most of to_dict, ~20 us a config)."""
    if cls not in _FIELD_NAMES:
        fields = dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else None
        _FIELD_NAMES[cls] = None if fields is None else tuple((f.name, _key(f.name)) for f in fields)
    return _FIELD_NAMES[cls]


_FieldChecks = tuple[tuple[str, str, tuple[Any, ...] | None, Range | None], ...]
_FIELD_CHECKS: dict[type, _FieldChecks] = {}


def _field_checks(cls: type[Section]) -> _FieldChecks:
    """Per field of a section: attribute, dotted key, Literal choices (or None), range (or None)."""
    if cls not in _FIELD_CHECKS:
        _FIELD_CHECKS[cls] = _make_field_checks(cls)
    return _FIELD_CHECKS[cls]


def _make_field_checks(cls: type[Section]) -> _FieldChecks:
    hints = _hints(typing.cast(type, cls))
    prefix = f"{cls.KEY}." if cls.KEY else ""
    return tuple(
        (
            f.name,
            prefix + _key(f.name),
            typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is Literal else None,
            f.metadata.get("range"),
        )
        for f in dataclasses.fields(cls)
    )


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type, values: dict[str, Any]) -> Any:
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        value = values[_key(f.name)]
        kwargs[f.name] = _build(hints[f.name], value) if dataclasses.is_dataclass(hints[f.name]) else value
    return cls(**kwargs)


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return " or ".join("null" if a is type(None) else a.__name__ for a in args)
    return getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any) -> Any:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        if value is None and type(None) in typing.get_args(tp):
            return None
        for arg in typing.get_args(tp):
            if arg is not type(None) and (out := _coerce(arg, value)) is not _INVALID:
                return out
        return _INVALID
    if tp is bool:
        return value if isinstance(value, bool) else _INVALID
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _INVALID
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        return _INVALID
    if tp is str:
        return value if isinstance(value, str) else _INVALID
    return _INVALID


_SCHEMA = _build_schema(RecipeConfig)
_DEFAULTS = _to_dict(RecipeConfig())


# ---------------------------------------------------------------------------------------------
# A run's process layout (docs/engines.md, "Process layout"): torch-free, so that `sweep launch`
# checks it on the login node and the job checks the tasks Slurm really started, with one rule.


@dataclass(frozen=True)
class Layout:
    """How one run's job tasks split: trainer ranks 0..T-1 first (whole nodes), then generators."""

    num_nodes: int
    tasks_per_node: int
    num_generators: int

    @property
    def num_tasks(self) -> int:
        return self.num_nodes * self.tasks_per_node

    @property
    def num_trainers(self) -> int:
        return self.num_tasks - self.num_generators

    def is_trainer(self, rank: int) -> bool:
        return rank < self.num_trainers

    def generator_index(self, rank: int) -> int:
        """Generator i is task T + i (and rank 1 + i of the weight group)."""
        if self.is_trainer(rank):
            raise ValueError(f"task {rank} is trainer rank {rank}, not a generator")
        return rank - self.num_trainers


def resolve_generator(requested: str, *, cuda: bool, vllm: bool) -> str:
    """`engine.generator` resolved for a machine: `auto` is vLLM where a GPU and vllm are both at
    hand (on generator ranks, or colocated in the one task of `generator_ranks: 0`), else torch."""
    if requested != "auto":
        return requested
    return "vllm" if cuda and vllm else "torch"


def check_layout(cfg: RecipeConfig, *, num_nodes: int, tasks_per_node: int) -> Layout:
    """The layout of `cfg`'s run on `num_nodes` x `tasks_per_node` tasks, or a ConfigError naming
    the key that cannot work with it."""
    layout = Layout(num_nodes, tasks_per_node, cfg.engine.generator_ranks)
    key, ranks, tasks = "engine.generator_ranks", cfg.engine.generator_ranks, layout.num_tasks
    shape = f"resources.nodes x resources.tasks_per_node = {num_nodes} x {tasks_per_node} = {tasks} task(s)"
    if ranks == 0 and tasks != 1:
        raise ConfigError(
            key, f"0 with {shape}: with no generator ranks generation and training alternate in one task; "
            "set engine.generator_ranks >= 1 or use one task"
        )  # fmt: skip
    if ranks >= tasks and ranks > 0:
        raise ConfigError(key, f"{ranks} with {shape}: leaves no trainer rank; must be below {tasks}")
    return layout
