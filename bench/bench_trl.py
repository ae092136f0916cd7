"""Training throughput of the recipe against TRL's GRPOTrainer on the same setup, in one process.

    python bench/bench_trl.py [--rounds 5] [--steps 40] [--warmup 5]

Both sides train the built-in `builtin:sort6-tiny` Llama (84k parameters, built offline on first
use by `recipe.tasks.builtin.resolve_model_dir`) with its tokenizer on sort6 training prompts, 8 prompts
x 8 generations per step, the generation cap of 7 tokens (six digits and EOS), temperature 1 with
no top-p/top-k, on CPU with one thread. The recipe runs its own loop (`recipe.loop.train.train_step`:
sampling, rewards, advantages, one AdamW step) with loss.type=grpo, loss.aggregation=sample,
advantage.norm=prompt and the filters off, which is what TRL's GRPOTrainer computes with
loss_type="grpo", scale_rewards="group", beta=0 (no reference model), on-policy (one
iteration per generation, so no old-log-prob pass). TRL gets fair settings: no gradient
checkpointing, fp32, no eval, no saving, no reporting, no completion logging, HF generate
(use_vllm=False), its reward function the project's sort6 scorer (`recipe.tasks.sort6.reward`, on the
decoded completion with its EOS).

The recipe runs three times per round: with `engine.kernels=reference` (the default: its training
is transformers' forward and torch's AdamW bit for bit), with `engine.kernels=fast` (each prompt
computed once for its group in the trainer's pass, the fused AdamW: the same math, rounded
differently) and with `engine.kernels=compiled` (fast, with its decode steps and its trainer's pass
through torch.compile). Sampling is the same with reference and fast. The compile happens in the
first round's warm-up, which is not timed (as no warm-up is); its cost is printed under the table.

Rounds alternate recipe, recipe-fast, recipe-compiled, TRL, recipe, ...: each round builds a fresh trainer on each
side, runs `--warmup` untimed steps and then `--steps` timed ones; the table gives the medians over
rounds. Nothing is downloaded (HF_HUB_OFFLINE=1; the dataset is built in memory). Prints a
Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import date
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ACCELERATE_USE_CPU", "true")
# A cold compile, as on a fresh machine: not the inductor cache an earlier run left in /tmp.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench-trl-inductor-"))
warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from recipe.config import resolve  # noqa: E402
from recipe.loop.checks import generation_cap  # noqa: E402
from recipe.loop.rollout import LocalRollouts  # noqa: E402
from recipe.loop.state import initial_state  # noqa: E402
from recipe.loop.train import train_step  # noqa: E402
from recipe.tasks import sort6, task as tasks
from recipe.tasks.builtin import resolve_model_dir  # noqa: E402

MODEL = "builtin:sort6-tiny"
PROMPTS, GENERATIONS = 8, 8
LR = 1e-4
KERNELS = {"recipe": "reference", "recipe-fast": "fast", "recipe-compiled": "compiled"}
SIDES = {
    "recipe": "recipe (`train_step`, engine.kernels=reference)",
    "recipe-fast": "recipe (`train_step`, engine.kernels=fast)",
    "recipe-compiled": "recipe (`train_step`, engine.kernels=compiled)",
    "trl": "TRL `GRPOTrainer`",
}


def recipe_config(kernels: str = "reference") -> object:
    return resolve(
        {
            "engine.kernels": kernels,
            "model.path": MODEL,
            "data.task": "sort6",
            "data.num_train_prompts": 4096,
            "data.num_valid_prompts": 16,
            "batch.prompts": PROMPTS,
            "batch.generations": GENERATIONS,
            "loss.type": "grpo",
            "loss.aggregation": "sample",
            "advantage.norm": "prompt",
            "filter.zero_variance": False,
            "filter.no_positive_resampling": False,
            "length.control": "none",
            "optim.lr": LR,
            "optim.warmup_steps": 0,
            "optim.max_grad_norm": 1.0,
            "engine.generator": "torch",
            "engine.trainer": "torch",
            "engine.threads": 1,
            "budget.steps": 1_000_000,
        }
    )


def time_recipe(steps: int, warmup: int, kernels: str = "reference") -> tuple[float, float]:
    """Seconds for `steps` recipe steps (after `warmup` untimed ones), a fresh run state; and the
    seconds of its first step (a compile, with engine.kernels=compiled, in the first round)."""
    cfg = recipe_config(kernels)
    task = tasks.load_task(cfg.data)  # type: ignore[attr-defined]
    state = initial_state(cfg, task, generation_cap(cfg, task, lambda _: None), lambda _: None)  # type: ignore[arg-type]
    source = LocalRollouts()
    started = time.perf_counter()
    train_step(state, source)  # the first warm-up step: the compile, for compiled in round 1
    first_step = time.perf_counter() - started
    for _ in range(warmup - 1):
        train_step(state, source)
    started = time.perf_counter()
    for _ in range(steps):
        train_step(state, source)
    return time.perf_counter() - started, first_step


class _Clock:
    """A TrainerCallback that notes the time at the end of every optimizer step."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def callback(self):  # the class is made here so that transformers is imported only when TRL runs
        from transformers import TrainerCallback

        clock = self

        class Clock(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                clock.ends.append(time.perf_counter())

        return Clock()


def trl_reward(tokenizer):
    """The project's sort6 scorer on TRL's completions: TRL decodes without special tokens, so
    the text is decoded again from the ids, EOS kept (as the recipe's `decode` does)."""

    def sort6(prompts, completions, completion_ids, **_):
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=False)
        return [sort6.reward(p, c) for p, c in zip(prompts, texts)]

    return sort6


def time_trl(steps: int, warmup: int, out_dir: str) -> float:
    """Seconds for `steps` GRPOTrainer steps (after `warmup` untimed ones), a fresh trainer."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    directory = resolve_model_dir(MODEL, lambda _: None)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    train_prompts, _ = sort6.sort6_prompt_sets(4096, 16)
    dataset = Dataset.from_dict({"prompt": train_prompts})
    args = GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=PROMPTS * GENERATIONS,
        gradient_accumulation_steps=1,
        num_generations=GENERATIONS,
        max_completion_length=sort6.SORT6_MAX_NEW_TOKENS,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        loss_type="grpo",
        scale_rewards="group",
        epsilon=0.2,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,
        max_grad_norm=1.0,
        max_steps=warmup + steps,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        logging_strategy="no",
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_vllm=False,
        seed=0,
    )
    clock = _Clock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=trl_reward(tokenizer),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock.callback()],
    )
    with contextlib.redirect_stdout(sys.stderr):  # its end-of-training summary is not the table
        trainer.train()
    if len(clock.ends) != warmup + steps:
        raise RuntimeError(f"TRL took {len(clock.ends)} steps, expected {warmup + steps}")
    return clock.ends[-1] - clock.ends[warmup - 1]


def _trl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trl")
    except PackageNotFoundError:
        return "not installed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per round and side")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per round and side (>= 1)")
    parser.add_argument("--only", choices=SIDES, default=None, help="time one side only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    resolve_model_dir(MODEL, print)  # build once, outside the timings
    sides = [args.only] if args.only else list(SIDES)
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    first_steps: dict[str, list[float]] = {side: [] for side in sides}  # per round, a recipe side's first step
    with tempfile.TemporaryDirectory() as out_dir:
        for round_ in range(args.rounds):
            for side in sides:
                if side == "trl":
                    elapsed = time_trl(args.steps, args.warmup, out_dir)
                else:
                    elapsed, first_step = time_recipe(args.steps, args.warmup, KERNELS[side])
                    first_steps[side].append(first_step)
                seconds[side].append(elapsed)
                print(f"round {round_ + 1} {side}: {args.steps / elapsed:.1f} steps/s", file=sys.stderr)
    completions = PROMPTS * GENERATIONS
    rows = {}
    for side in sides:
        steps_per_s = [args.steps / s for s in seconds[side]]
        rows[side] = statistics.median(steps_per_s), min(steps_per_s), max(steps_per_s)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    machine = platform.processor() or platform.machine()
    print(f"{date.today()}, {machine}, torch {torch.__version__}, TRL {_trl_version()}, 1 thread")
    print(f"load: {load}")
    print(f"{args.rounds} alternating rounds x {args.steps} timed steps ({args.warmup} warm-up) per side\n")
    print("| side | steps/s (median) | completions/s (median) | steps/s range | vs TRL |")
    print("| --- | ---: | ---: | --- | ---: |")
    trl_median = rows["trl"][0] if "trl" in rows else None
    for side in sides:
        median, low, high = rows[side]
        name = SIDES[side]
        ratio = f"{median / trl_median:.2f}x" if trl_median else "-"
        print(f"| {name} | {median:.1f} | {median * completions:.0f} | {low:.1f}-{high:.1f} | {ratio} |")
    if first_steps.get("recipe-compiled"):
        first, last = first_steps["recipe-compiled"][0], first_steps["recipe-compiled"][-1]
        print(
            f"\nengine.kernels=compiled: its first step took {first:.1f} s in round 1 and {last:.2f} s in the "
            f"last round: ~{first - last:.0f} s of compile, once per process (untimed warm-up, excluded from steps/s)"
        )


if __name__ == "__main__":
    main()
