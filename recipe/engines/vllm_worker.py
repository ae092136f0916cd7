"""Inside vLLM's worker: the project's gloo weight-transfer backend (CPU), registered on import.

vLLM's stock `nccl` weight-transfer backend cannot run on CPU ("Cannot access accelerator
device"), so on CPU the vLLM generator uses this one, under the same four calls
(`init_weight_transfer_engine`, `start_weight_update`, `update_weights`, `finish_weight_update`).
Its receive side is `recipe.engines.weights.receive_into`: the wire is the project's weight
group, so the trainer's one `TorchWeightSender` feeds vLLM and torch generators alike.

vLLM runs its engine core (and so this worker) in a child process; the engine is created there
from `weight_transfer_config.backend`. The module is named in `worker_extension_cls`
(`GlooWorkerExtension`), which vLLM imports in the worker before it creates the engine, so the
import's side effect (registering "gloo") happens in the process that needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from recipe.engines.weights import WeightGroupSpec, init_weight_group, receive_into

BACKEND = "gloo"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the weight group meets and this engine's rank in it (`rank_offset`, 1 + generator index)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 300.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One push's meta, as vLLM's nccl backend takes it (the same keys)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes must be as long: {len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}"
            )


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives a push over the project's gloo weight group and loads it tensor by tensor as each bucket lands."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: torch.distributed.ProcessGroup | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        # One worker per engine (TP=1): the engine's rank is its offset.
        if self.parallel_config.world_size != 1:
            raise RuntimeError(
                f"the gloo weight transfer supports tensor_parallel_size 1, got world size {self.parallel_config.world_size}"
            )
        spec = WeightGroupSpec(
            host=init_info.master_address,
            port=init_info.master_port,
            num_generators=init_info.world_size - 1,
            timeout_s=init_info.timeout_s,
        )
        self.group = init_weight_group(spec, rank=init_info.rank_offset)

    def start_weight_update(self) -> None:
        # The same layerwise-reload lifecycle as vLLM's nccl backend: it lets checkpoint-format
        # (unfused) weights load into the fused layers and reruns each layer's post-processing.
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which fails on CPU; gloo's
        # broadcasts have completed (each is waited on) by the time receive_weights returns.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: call init_weight_transfer_engine first")
        meta = tuple(
            (n, d, tuple(s)) for n, d, s in zip(update_info.names, update_info.dtype_names, update_info.shapes)
        )
        for name, tensor in receive_into(self.group, meta):
            self.model.load_weights([(name, tensor)])

    def shutdown(self) -> None:
        self.group = None


class GlooWorkerExtension:
    """Named in `worker_extension_cls` so that vLLM imports this module in its worker process."""


if BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
