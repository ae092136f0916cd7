"""The tiny Llama, its tokenizer, the fp32 head, and the built-in model cache."""

import threading

import pytest
import torch
from safetensors.torch import load_file

from recipe.config import ConfigError
from recipe.model.policy import (
    TinyLlamaShape,
    build_tiny_llama,
    load_policy,
    matmul_param_count,
)
from recipe.model.precision import upcast_lm_head
from recipe.tasks import builtin, sort6

QUICK = builtin.WarmupRecipe(num_steps=2, batch_size=8)


pytestmark = [pytest.mark.usefixtures("torch_one_thread"), pytest.mark.isa]


def test_tokenizer_maps_each_symbol_to_its_vocabulary_position(tokenizer):
    prompt = sort6.make_prompt(471, 903)
    assert tokenizer(prompt).input_ids == [sort6.VOCABULARY.index(s) for s in prompt.split()]
    assert tokenizer.eos_token_id == sort6.VOCABULARY.index(sort6.EOS)
    assert tokenizer.pad_token_id == sort6.VOCABULARY.index(sort6.PAD)
    assert tokenizer.decode(tokenizer("0 1 2 </s>").input_ids) == "0 1 2 </s>"


def test_tiny_llama_shape_and_parameter_count(tokenizer):
    model = build_tiny_llama(TinyLlamaShape(), tokenizer, seed=0)
    assert model.config.head_dim == 64  # what vLLM's CPU attention requires
    assert sum(p.numel() for p in model.parameters()) == 84_032
    assert matmul_param_count(model) == 84_032 - len(sort6.VOCABULARY) * 64
    same = build_tiny_llama(TinyLlamaShape(), tokenizer, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))


def test_saved_directory_loads_back_identically(tokenizer, tmp_path):
    model = build_tiny_llama(TinyLlamaShape(), tokenizer, seed=1)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = load_policy(tmp_path, dtype="auto", lm_head_fp32=True)
    ids = tokenizer(["1 2 3 + 4 5 6 ="], return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert loaded.dtype == torch.float32
    assert loaded_tokenizer.get_vocab() == tokenizer.get_vocab()


def test_fp32_head_is_real_for_a_bf16_model(tokenizer):
    ids = tokenizer(["1 2 3 + 4 5 6 ="], return_tensors="pt").input_ids
    plain = build_tiny_llama(TinyLlamaShape(), tokenizer, seed=2).to(torch.bfloat16)
    assert plain(input_ids=ids).logits.dtype == torch.bfloat16
    model = build_tiny_llama(TinyLlamaShape(), tokenizer, seed=2).to(torch.bfloat16)
    upcast_lm_head(model)
    assert model.lm_head.weight.dtype == torch.bfloat16  # the weight stays; the head computes in fp32
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert model(input_ids=ids).logits.dtype == torch.float32


def test_fp32_head_changes_nothing_for_an_fp32_model(tokenizer):
    ids = tokenizer(["1 2 3 + 4 5 6 ="], return_tensors="pt").input_ids
    model = build_tiny_llama(TinyLlamaShape(), tokenizer, seed=3)
    before = model(input_ids=ids).logits
    upcast_lm_head(model)
    assert torch.equal(model(input_ids=ids).logits, before)


def test_builtin_model_is_built_once_and_loadable(tmp_path):
    logs: list[str] = []
    directory = builtin.builtin_model_dir("sort6-tiny", QUICK, tmp_path, logs.append)
    assert {"config.json", "model.safetensors", "tokenizer.json", "warmup.json"} <= {
        p.name for p in directory.iterdir()
    }
    assert sum("building" in m for m in logs) == 1
    assert directory.stat().st_mode & 0o777 == 0o755
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in directory.iterdir())
    assert builtin.builtin_model_dir("sort6-tiny", QUICK, tmp_path, logs.append) == directory
    assert sum("building" in m for m in logs) == 1
    model, tokenizer = load_policy(directory, dtype="auto", lm_head_fp32=True)
    assert tokenizer.eos_token_id == sort6.VOCABULARY.index(sort6.EOS)


def test_builtin_build_is_deterministic_and_keyed_by_its_recipe(tmp_path):
    first = builtin.builtin_model_dir("sort6-tiny", QUICK, tmp_path / "a", lambda _: None)
    second = builtin.builtin_model_dir("sort6-tiny", QUICK, tmp_path / "b", lambda _: None)
    assert first.name == second.name
    weights_a, weights_b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    other = builtin.WarmupRecipe(num_steps=3, batch_size=8)
    assert other.cache_key() != QUICK.cache_key()


def test_concurrent_requests_build_once(tmp_path):
    logs: list[str] = []
    results: list = []

    def request():
        results.append(builtin.builtin_model_dir("sort6-tiny", QUICK, tmp_path, logs.append))

    threads = [threading.Thread(target=request) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 3
    assert sum("building" in m for m in logs) == 1
    assert [p.name for p in (tmp_path / "models").iterdir() if p.is_dir()] == [results[0].name]


def test_resolve_model_dir_uses_sweep_cache_and_checks_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("SWEEP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(builtin.BUILTINS, "sort6-tiny", QUICK)
    directory = builtin.resolve_model_dir("builtin:sort6-tiny", log=lambda _: None)
    assert directory.parent == tmp_path / "cache" / "models"
    assert builtin.resolve_model_dir(str(directory)) == directory
    with pytest.raises(ConfigError, match="model.path.*builtin:sort6-tiny"):
        builtin.resolve_model_dir("builtin:sort7")
    with pytest.raises(ConfigError, match="model.path.*no config.json"):
        builtin.resolve_model_dir(str(tmp_path))
