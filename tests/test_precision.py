"""Generator-vs-trainer log-prob agreement on the same weights, by precision (torch engine).

Tolerances are stated against what bench/bench_logprobs.py (`recipe.model.mismatch`) measured here (bench/RESULTS.md):
fp32 agrees to ~4e-6 at worst; bfloat16 with the same head on both sides agrees to ~1e-6 on
average; a head in fp32 on one side only is thousands of times worse, which is why
`precision.lm_head_fp32` applies to the generator and the trainer alike.
"""

from __future__ import annotations

import pytest

from recipe.model.mismatch import mismatch

pytestmark = [pytest.mark.usefixtures("torch_one_thread"), pytest.mark.isa]


def test_fp32_generator_and_trainer_agree():
    worst, mean = mismatch("fp32", num_prompts=64, num_samples=4)
    assert worst < 5e-5 and mean < 5e-6, (worst, mean)


@pytest.mark.parametrize("case", ["bf16", "bf16+fp32head"])
def test_bf16_with_the_same_head_on_both_sides_agrees(case):
    worst, mean = mismatch(case, num_prompts=64, num_samples=4)
    assert worst < 0.05 and mean < 1e-4, (worst, mean)


def test_an_fp32_head_on_one_side_only_is_far_worse():
    _, fp32_mean = mismatch("fp32", num_prompts=64, num_samples=4)
    _, both_mean = mismatch("bf16+fp32head", num_prompts=64, num_samples=4)
    _, one_mean = mismatch("one side (trainer fp32 head only)", num_prompts=64, num_samples=4)
    assert one_mean > 100 * max(fp32_mean, both_mean), (fp32_mean, both_mean, one_mean)


# --- recipe.model.precision: the body's dtype and the FP32 LM head (weight in the body's dtype) ---------

import torch  # noqa: E402

from recipe.model.policy import TinyLlamaShape, build_tiny_llama, build_tokenizer  # noqa: E402
from recipe.model.precision import body_dtype, has_fp32_head, upcast_lm_head, vllm_dtype  # noqa: E402
from recipe.tasks import sort6  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_tokenizer(sort6.VOCABULARY, eos=sort6.EOS, pad=sort6.PAD)
    ids = tokenizer(["1 2 3 + 4 5 6 =", "9 8 7 + 0 1 2 ="], return_tensors="pt").input_ids
    return tokenizer, ids


def test_a_bf16_body_with_the_fp32_head_gives_fp32_logits_and_bf16_gradients(tiny):
    tokenizer, ids = tiny
    model = upcast_lm_head(build_tiny_llama(TinyLlamaShape(), tokenizer, seed=2).to(torch.bfloat16))
    assert has_fp32_head(model)
    logits = model(input_ids=ids).logits
    assert logits.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.bfloat16  # the weight is pushed as it is trained
    torch.log_softmax(logits, dim=-1)[:, -1, 3].sum().backward()
    head_grad, body_grad = model.lm_head.weight.grad, model.model.layers[0].mlp.up_proj.weight.grad
    assert head_grad.dtype == torch.bfloat16 and head_grad.abs().sum() > 0
    assert body_grad.dtype == torch.bfloat16 and body_grad.abs().sum() > 0


def test_the_fp32_head_is_vllms_cast_of_both_operands(tiny):
    # vLLM's LogitsProcessor with head_dtype float32 on CPU: F.linear(h.float(), W.float()).
    tokenizer, ids = tiny
    model = build_tiny_llama(TinyLlamaShape(), tokenizer, seed=4).to(torch.bfloat16)
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        plain = model.lm_head(hidden)
        upcast_lm_head(model)
        fp32 = model(input_ids=ids).logits
    assert plain.dtype == torch.bfloat16
    assert torch.equal(fp32, torch.nn.functional.linear(hidden.float(), model.lm_head.weight.float()))
    assert not torch.equal(fp32, plain.float())  # bf16 logits are rounded; the fp32 ones are not


def test_the_fp32_head_changes_nothing_for_an_fp32_model_and_keeps_a_tied_head_tied(tiny):
    tokenizer, ids = tiny
    model = build_tiny_llama(TinyLlamaShape(), tokenizer, seed=3)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        upcast_lm_head(model)
        assert torch.equal(model(input_ids=ids).logits, before)
    tied = build_tiny_llama(TinyLlamaShape(), tokenizer, seed=3).to(torch.bfloat16)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    upcast_lm_head(tied)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_model_dtype_names():
    assert body_dtype("auto", "cpu") == torch.float32 and body_dtype("auto", "cuda") == torch.bfloat16
    assert body_dtype("bfloat16") == torch.bfloat16 and vllm_dtype("auto") == "float32"
    with pytest.raises(ValueError, match="model.dtype must be one of"):
        body_dtype("float16")
