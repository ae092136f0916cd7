"""vLLM colocated with the trainer: one task, `engine.generator_ranks: 0`, generation at vLLM's speed.

What TRL's colocate mode and verl's hybrid engine do, in the trainer's own process:

- **One engine in the trainer's process.** vLLM's offline `LLM` with its engine core in process
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, one worker, TP 1), on the trainer's GPU, taking
  `engine.gpu_memory_utilization` of it (0.3 by default: the trainer keeps the rest).
- **Weights loaded in place.** Before each generation whose policy version the engine does not
  hold yet, the trainer's weights (`Trainer.named_weights`, the working weights, on the same
  device) go straight into the engine's model (`LLM.collective_rpc("reload_weights")`, the
  worker's in-place reload of checkpoint-format weights into its fused, post-processed layers:
  no process group, no copy through the host), and the prefix cache is reset so that no KV block
  computed with older weights is reused. So generation after optimizer step v samples from
  version v, as the plain torch path does (lag 0 under `pipeline`; k batches of one policy under
  `ppo-offpolicy`).
- **Memory released while training.** Where vLLM offers sleep mode (CUDA, ROCm, XPU), the engine
  sleeps at level 2 (KV cache and weights freed) before every optimizer step
  (`ColocatedTrainer`) and wakes before the next generation: weights first, loaded, then the KV
  cache. On CPU the engine stays awake.
- **The same batches.** `ColocatedVllm.sample` returns `recipe.model.sampler.Completions`, exactly what
  the torch sampler returns: the rest of the loop (rewards, advantages, the update, evaluation)
  does not know which engine sampled. Behaviour log-probs are vLLM's processed log-probs at
  temperature 1 with the fp32 head (`recipe.engines.vllm_engine.VllmSettings`), the quantity the
  trainer computes. Seeds come from the run's sampling stream, so a resumed run draws the same ones.
- **Forced interruption** (`length.control=interrupt`), as `recipe.model.sampler` defines it: a row is
  first sampled up to its thinking budget; a row that has not closed its thinking by then gets the
  interruption phrase appended (forced tokens, their log-probs the policy's own, from the
  continuation's prompt log-probs) and its answer sampled by a continuation request; a row that
  closed its thinking within its budget continues unforced.

vLLM changes its host process in ways a trainer must not see; the engine undoes them: it seeds the
global random generators (restored around every call), replaces `torch.set_num_threads` on CPU
(restored after start), and makes a one-rank default process group when there is none (destroyed
at `close`; an existing group, a DeepSpeed trainer's, is reused and left alone).
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from transformers import PreTrainedTokenizerBase

from recipe.config import RecipeConfig
from recipe.engines.base import TrainBatch, Trainer
from recipe.engines.vllm_engine import CPU_ENV_DEFAULTS, VllmSettings, require_vllm, settings_from_config
from recipe.model.sampler import Completions, Interrupt
from recipe.tasks.builtin import resolve_model_dir

SEED_MODULUS = 2**31 - 1


@dataclass
class _Row:
    """One completion being assembled from up to two requests."""

    prompt: list[int]
    tokens: list[int]
    logps: list[float]
    forced: list[bool]
    finished: bool = False


class ColocatedVllm:
    """An in-process vLLM engine that samples `Completions` from the trainer's current weights."""

    def __init__(self, settings: VllmSettings, *, eos_id: int, pad_id: int) -> None:
        require_vllm()
        self.settings, self.eos_id, self.pad_id = settings, eos_id, pad_id
        self.version: int | None = None
        """The policy version the engine's weights are; None: not loaded since start or sleep."""
        self.asleep = False
        self.loads = 0
        """Weight loads so far (one per new policy version generated from)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
        if settings.resolved_device == "cpu":
            for key, value in CPU_ENV_DEFAULTS.items():
                os.environ.setdefault(key, value)
        import torch.distributed as dist
        from vllm import LLM
        from vllm.platforms import current_platform

        self._owns_default_group = not (dist.is_available() and dist.is_initialized())
        self.sleep_mode = bool(current_platform.is_sleep_mode_available())
        threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
        with _host_rng_kept():
            self.llm = LLM(**colocated_engine_args(settings, sleep_mode=self.sleep_mode))
        torch.set_num_threads = set_num_threads  # vLLM's CPU worker replaces it with a no-op
        torch.set_num_threads(threads)

    # -- weights and memory ---------------------------------------------------------------------

    def sync(self, weights: Callable[[], Iterable[tuple[str, torch.Tensor]]], version: int) -> None:
        """Hold policy `version`: wake up and load `weights()` in place unless it is there already."""
        if self.version == version and not self.asleep:
            return
        if self.asleep:
            self.llm.wake_up(tags=["weights"])  # the KV cache after the load: the two never overlap
        named = [(name, tensor.detach()) for name, tensor in weights()]
        with _host_rng_kept(), torch.no_grad():
            # The worker's in-place reload: checkpoint-format weights into the fused, post-processed
            # layers (vLLM's layerwise reload). In process, so the tensors pass by reference.
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named)})
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # no KV block of older weights is reused
        self.version = version
        self.loads += 1

    def release(self) -> None:
        """Free the engine's GPU memory for the trainer (sleep level 2: its weights are reloaded anyway)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep, self.version = True, None

    # -- sampling -------------------------------------------------------------------------------

    def sample(
        self,
        prompt_ids_BP: torch.Tensor,
        prompt_mask_BP: torch.Tensor | None,
        *,
        max_new_tokens: int,
        seed: int,
        interrupt: Interrupt | None = None,
    ) -> Completions:
        """Complete every row until EOS or `max_new_tokens`; row i is seeded from `seed` and i."""
        if self.asleep or self.version is None:
            raise RuntimeError("ColocatedVllm.sample before sync: the engine holds no policy weights")
        prompts = [
            row if mask is None else [t for t, real in zip(row, mask) if real]
            for row, mask in zip(prompt_ids_BP.tolist(), _rows(prompt_mask_BP, len(prompt_ids_BP)))
        ]
        rows = [_Row(p, [], [], []) for p in prompts]
        budgets = [max_new_tokens] * len(rows) if interrupt is None else interrupt.budget_B.tolist()
        first = [min(int(b), max_new_tokens) for b in budgets]
        todo = [i for i, n in enumerate(first) if n > 0]
        self._extend(rows, todo, [first[i] for i in todo], seed, attempt=0)
        if interrupt is not None:
            self._after_budget(rows, interrupt, max_new_tokens, seed)
        return self._completions(rows, interrupt is not None)

    def _after_budget(self, rows: list[_Row], interrupt: Interrupt, cap: int, seed: int) -> None:
        """Rows at their thinking budget: close thinking with the phrase (forced) and answer."""
        go_on, room = [], []
        for i, row in enumerate(rows):
            left = cap - len(row.tokens)
            if row.finished or left <= 0:
                continue
            if interrupt.close_id not in row.tokens:  # still thinking: the phrase, as far as it fits
                phrase = list(interrupt.phrase_ids[:left])
                row.tokens += phrase
                row.forced += [True] * len(phrase)
                row.logps += [0.0] * len(phrase)  # replaced by the policy's own below
                left -= len(phrase)
            go_on.append(i)
            room.append(left)
        self._extend(rows, go_on, room, seed, attempt=1, forced_logps=True)

    def _extend(
        self,
        rows: list[_Row],
        which: Sequence[int],
        max_tokens: Sequence[int],
        seed: int,
        *,
        attempt: int,
        forced_logps: bool = False,
    ) -> None:
        """One request per row in `which`: its prompt and tokens so far, up to `max_tokens` more."""
        if not which:
            return
        from vllm import SamplingParams

        params = [
            SamplingParams(
                n=1,
                max_tokens=max(1, n),  # 0 left: a request for the forced tokens' log-probs only
                temperature=self.settings.temperature,
                seed=(seed + attempt * len(rows) + i) % SEED_MODULUS,
                logprobs=0,
                prompt_logprobs=0 if forced_logps and any(rows[i].forced) else None,
                detokenize=False,
            )
            for i, n in zip(which, max_tokens)
        ]
        requests = [{"prompt_token_ids": rows[i].prompt + rows[i].tokens} for i in which]
        with _host_rng_kept():
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        for i, n, out in zip(which, max_tokens, outputs):
            row = rows[i]
            if out.prompt_logprobs is not None:  # the forced tokens: the policy's own log-probs
                for j, forced in enumerate(row.forced):
                    if forced:
                        row.logps[j] = out.prompt_logprobs[len(row.prompt) + j][row.tokens[j]].logprob
            if n <= 0:
                continue
            (completion,) = out.outputs
            sampled = list(completion.token_ids)
            row.tokens += sampled
            row.logps += [step[t].logprob for step, t in zip(completion.logprobs, sampled)]
            row.forced += [False] * len(sampled)
            row.finished = completion.finish_reason == "stop"

    def _completions(self, rows: list[_Row], interrupted: bool) -> Completions:
        width = max(1, max(len(r.tokens) for r in rows))
        tokens_BT = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        logp_BT = torch.zeros((len(rows), width))
        mask_BT = torch.zeros((len(rows), width), dtype=torch.bool)
        forced_BT = torch.zeros((len(rows), width), dtype=torch.bool)
        for b, row in enumerate(rows):
            n = len(row.tokens)
            tokens_BT[b, :n] = torch.tensor(row.tokens, dtype=torch.long)
            logp_BT[b, :n] = torch.tensor(row.logps)
            mask_BT[b, :n] = True
            forced_BT[b, :n] = torch.tensor(row.forced, dtype=torch.bool)
        finished_B = torch.tensor([r.finished for r in rows], dtype=torch.bool)
        return Completions(tokens_BT, logp_BT, mask_BT, finished_B, forced_BT if interrupted else None)

    def close(self) -> None:
        """Shut the engine down and leave the default group as it was found."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        llm.llm_engine.engine_core.shutdown()
        del llm
        destroy_model_parallel()
        if self._owns_default_group:
            destroy_distributed_environment()


def colocated_engine_args(settings: VllmSettings, *, sleep_mode: bool) -> dict[str, Any]:
    """`LLM`'s keyword arguments: the generator's engine, without a weight-transfer backend
    (weights come in place), with sleep mode where the platform has it."""
    args = settings.engine_args()
    for key in ("weight_transfer_config", "worker_extension_cls"):
        args.pop(key, None)
    return args | {"enable_sleep_mode": sleep_mode}


def _rows(mask_BP: torch.Tensor | None, num_rows: int) -> Iterator[list[bool] | None]:
    if mask_BP is None:
        yield from [None] * num_rows
    else:
        yield from mask_BP.tolist()


@contextlib.contextmanager
def _host_rng_kept() -> Iterator[None]:
    """vLLM seeds the global generators of the process it runs in; the trainer's must not move."""
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def draw_seed(generator: torch.Generator) -> int:
    """A request seed from the run's sampling stream (checkpointed, so a resume draws the same)."""
    return int(torch.randint(0, SEED_MODULUS, (1,), generator=generator, device=generator.device))


def colocate(
    cfg: RecipeConfig, trainer: Trainer, tokenizer: PreTrainedTokenizerBase, log: Callable[[str], None]
) -> tuple[ColocatedVllm, ColocatedTrainer]:
    """The run's vLLM engine in this process, and the trainer that lets it sleep while it steps."""
    settings = settings_from_config(cfg, str(resolve_model_dir(cfg.model.path, log)), shares_gpu=True)
    engine = ColocatedVllm(settings, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    memory = f"{settings.gpu_memory_utilization:.2f} of the GPU's memory" if settings.resolved_device == "cuda" else "CPU"
    log(
        f"engine.generator={cfg.engine.generator} with engine.generator_ranks=0: vLLM colocated in the trainer's "
        f"process ({memory}; weights loaded in place after each step; "
        f"{'sleeps while training' if engine.sleep_mode else 'no sleep mode on this platform'})"
    )
    return engine, ColocatedTrainer(trainer, engine)


class ColocatedTrainer:
    """The run's trainer, with the colocated engine put to sleep before each optimizer step (and
    before checkpoints' gathers), so training has the GPU's memory."""

    def __init__(self, inner: Trainer, engine: ColocatedVllm) -> None:
        self.inner, self.engine = inner, engine

    def step(self, batch: TrainBatch, *, lr: float) -> dict[str, float]:
        self.engine.release()
        return self.inner.step(batch, lr=lr)

    def __getattr__(self, name: str) -> Any:  # eval_model, named_weights, state_dict, ...: the trainer's
        return getattr(self.inner, name)
