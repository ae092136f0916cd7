"""The lean Llama forward (recipe.lean) against transformers' own, and the fused AdamW switch."""

import pytest
import torch

from recipe import tasks
from recipe.builtin import SUMK_SMALL_SHAPE
from recipe.engines.torch_trainer import TorchTrainer
from recipe.lean import lean_llama
from recipe.model import TinyLlamaShape, build_tiny_llama, build_tokenizer, completion_logprobs
from recipe.precision import upcast_lm_head

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(tasks.VOCABULARY, eos=tasks.EOS, pad=tasks.PAD)


@pytest.mark.parametrize("shape", [TinyLlamaShape(), SUMK_SMALL_SHAPE], ids=["1-head", "2-heads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_and_gradients_are_transformers_bit_for_bit(tokenizer, shape, dtype):
    model = build_tiny_llama(shape, tokenizer, seed=0).to(dtype)
    lean = lean_llama(model)
    assert lean is not None
    ids = torch.randint(0, len(tokenizer), (16, 14), generator=torch.Generator().manual_seed(0))
    want = model(input_ids=ids, logits_to_keep=7).logits
    want.float().square().sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    got = lean.logits(ids, 7)
    got.float().square().sum().backward()
    assert torch.equal(got, want)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want_grads))


def test_cached_decoding_matches_the_full_forward(tokenizer):
    model = build_tiny_llama(SUMK_SMALL_SHAPE, tokenizer, seed=0)
    lean = lean_llama(model)
    ids = torch.randint(0, len(tokenizer), (8, 14), generator=torch.Generator().manual_seed(1))
    cache = lean.new_cache(8, 14, ids.device)
    with torch.no_grad():
        steps = [lean.extend(cache, ids[:, :8])] + [lean.extend(cache, ids[:, t : t + 1]) for t in range(8, 14)]
        full = model(input_ids=ids).logits[:, 7:]
    torch.testing.assert_close(torch.stack(steps, dim=1), full, atol=1e-5, rtol=0)


def test_what_it_cannot_reproduce_takes_the_transformers_path(tokenizer):
    model = build_tiny_llama(TinyLlamaShape(), tokenizer, seed=0)
    assert lean_llama(model) is not None
    handle = model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: out * 2)
    assert lean_llama(model) is None  # a hook would be skipped
    handle.remove()
    assert lean_llama(model) is not None
    eager = build_tiny_llama(TinyLlamaShape(), tokenizer, seed=0)
    eager.config._attn_implementation = "eager"
    assert lean_llama(eager) is None
    # The FP32 head: its replaced forward is called as it is.
    bf16 = upcast_lm_head(build_tiny_llama(TinyLlamaShape(), tokenizer, seed=0).to(torch.bfloat16))
    ids = torch.randint(0, len(tokenizer), (4, 10))
    with torch.no_grad():
        got = completion_logprobs(bf16, ids[:, :8], ids[:, 8:])
        logits = bf16(input_ids=ids[:, :9], logits_to_keep=2).logits
    assert logits.dtype == torch.float32
    assert torch.equal(got, torch.log_softmax(logits, -1).gather(-1, ids[:, 8:, None]).squeeze(-1))


def test_the_torch_trainer_fuses_adamw_and_checkpoints_it_as_built(tokenizer):
    from recipe.config import resolve

    model = build_tiny_llama(TinyLlamaShape(), tokenizer, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = TorchTrainer(model, optimizer, resolve({}).loss, max_grad_norm=1.0)
    assert all(g["fused"] for g in optimizer.param_groups)
    state = trainer.state_dict()
    assert all(g["fused"] is None and g["foreach"] is None for g in state["optimizer"]["param_groups"])
    trainer.load_state_dict(state)
    assert all(g["fused"] for g in optimizer.param_groups)
