"""The lean Llama forward (recipe.model.lean) against transformers' own.

Every comparison runs the same thing twice, once with `SWEEP_LEAN=0` (transformers) and once with
the lean path, from the same weights and the same generator seed.

What is bit for bit (`torch.equal`) and what is not: where both sides run the same operations on
tensors of the same shapes in the same order (the trainer's forward and backward, sampling without
a shared prefill), the results are equal on any one machine, whatever its CPU. Where the lean side
computes a group's prompt once and transformers computes every row of the batch (sampling's shared
prefill, and so whole training steps), the matmuls have other row counts, and the CPU's kernels
(MKL, oneDNN, ATen's vectorised loops) choose their blocking, and so the order of each dot
product's sum, by row count and instruction set: equal on some CPUs, a few ulps apart on others
(Intel Xeons). Those comparisons assert `assert_within_ulps`, whose budget is derived there.

The module is marked `isa`: tests/test_isas.py runs it again under `ATEN_CPU_CAPABILITY=avx2` and
`default`, so that other kernels' choices are exercised whatever CPU runs the suite.
"""

import contextlib
import dataclasses

import pytest
import torch

from recipe.config import resolve
from recipe.loop.checks import generation_cap, interrupt_rule
from recipe.loop.evaluate import evaluate
from recipe.loop.rollout import LocalRollouts
from recipe.loop.state import initial_state
from recipe.loop.train import train_step
from recipe.model import compiled, lean
from recipe.model.lean import LeanCache, lean_llama
from recipe.model.packing import RowGroups
from recipe.model.policy import TinyLlamaShape, build_tiny_llama, build_tokenizer, completion_logprobs
from recipe.model.precision import upcast_lm_head
from recipe.model.sampler import Decoding, InterruptRule, Sampling, sample
from recipe.tasks import sort6, sumk
from recipe.tasks.builtin import SUMK_SMALL_SHAPE
from recipe.tasks.task import load_task

pytestmark = [pytest.mark.usefixtures("torch_one_thread"), pytest.mark.isa]

SHAPES = {"1-head": TinyLlamaShape(), "2-heads": SUMK_SMALL_SHAPE}
PRECISIONS = {
    "fp32": (torch.float32, False),
    "fp32-head32": (torch.float32, True),
    "bf16": (torch.bfloat16, False),
    "bf16-head32": (torch.bfloat16, True),
}


@contextlib.contextmanager
def lean_off(monkeypatch):
    with monkeypatch.context() as m:
        m.setenv("SWEEP_LEAN", "0")
        yield


def policy(vocabulary, eos, pad, shape, precision, seed=0):
    tokenizer = build_tokenizer(vocabulary, eos=eos, pad=pad)
    dtype, head32 = PRECISIONS[precision]
    model = build_tiny_llama(shape, tokenizer, seed=seed)
    with torch.no_grad():  # make EOS likely so that sequences end at different lengths
        model.lm_head.weight[tokenizer.eos_token_id] += 0.3 * model.model.norm.weight
    model = model.to(dtype)
    if head32:
        upcast_lm_head(model)
    return model, tokenizer


def sort6_policy(shape="1-head", precision="fp32", seed=0):
    return policy(sort6.VOCABULARY, sort6.EOS, sort6.PAD, SHAPES[shape], precision, seed)


# A budget of ulps (the dtype's eps times the largest magnitude of the reference tensor) for the
# same function computed with dot products summed in another order. Derived from measurements on the
# shapes used here: the lean prefill's logits, keys and values in fp32 are within 12.4 ulps of the
# same forward in float64 (the 2-heads shape; 1.3-4 for the others), and in bf16 within 2.1 bf16
# ulps of the bf16-weighted forward in float64. Any two summation orders are each that close to the
# exact result, so within twice that of each other: 25 fp32 ulps and 4.2 bf16 ulps. The budgets
# leave a margin of 2-2.5x for other weights and prompts; a real error (a row given another row's
# prompt, a wrong position) is off by a sizeable fraction of the magnitude, thousands of fp32 ulps.
ULPS = {torch.float32: 64, torch.bfloat16: 8}


def assert_within_ulps(got, want, dtype=None):
    """`got` is `want` computed in another summation order: within `ULPS` of want's magnitude, in
    ulps of `dtype`, the precision the values were computed in (default: want's own)."""
    dtype = dtype or want.dtype
    assert got.shape == want.shape and got.dtype == want.dtype
    ulp = torch.finfo(dtype).eps * float(want.abs().max())
    worst = float((got.double() - want.double()).abs().max())
    assert worst <= ULPS[dtype] * ulp, f"{worst / ulp:.1f} ulps of {dtype} apart; {ULPS[dtype]} allowed"


def assert_same_completions(a, b, *, exact=True, dtype=None):
    """The same sampled completions; with `exact`, the same log-probs bit for bit, otherwise up to
    `assert_within_ulps` of the model's `dtype`. (Tokens are compared exactly either way: a few ulps
    change a draw only where the uniform number falls within them of a boundary, about one draw in
    a million, and the seeds here are fixed.)"""
    assert torch.equal(a.tokens_BT, b.tokens_BT)
    if exact:
        assert torch.equal(a.logp_BT, b.logp_BT)
    else:
        assert_within_ulps(b.logp_BT, a.logp_BT, dtype)
    assert torch.equal(a.mask_BT, b.mask_BT)
    assert torch.equal(a.finished_B, b.finished_B)
    assert (a.forced_BT is None) == (b.forced_BT is None)
    if a.forced_BT is not None:
        assert torch.equal(a.forced_BT, b.forced_BT)


def sample_both(monkeypatch, model, tokenizer, prompt_ids, *, seed=0, **kwargs):
    def once():
        generator = torch.Generator().manual_seed(seed)
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        return sample(model, prompt_ids, Sampling(eos_id=eos, pad_id=pad, generator=generator, **kwargs))

    with lean_off(monkeypatch):
        assert lean_llama(model) is None
        want = once()
    assert lean_llama(model) is not None
    return want, once()


# ---------------------------------------------------------------------------------------------
# Sampling


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_sort6_sampling_is_transformers(monkeypatch, shape, precision):
    """Bit for bit with distinct prompts; groups of repeated prompts share their prefill on the
    lean side (other row counts in its matmuls): up to rounding."""
    model, tokenizer = sort6_policy(shape, precision)
    _, prompts = sort6.sort6_prompt_sets(1, 64)
    distinct = tokenizer(prompts, return_tensors="pt").input_ids
    dtype = PRECISIONS[precision][0]
    for prompt_ids, exact in ((distinct, True), (distinct.repeat_interleave(2, dim=0), False)):
        assert (RowGroups.of(prompt_ids) is None) == exact
        want, got = sample_both(monkeypatch, model, tokenizer, prompt_ids, max_new_tokens=7)
        assert 1 < len(set(got.lengths_B.tolist())), "completions of different lengths: EOS and padding are exercised"
        assert_same_completions(want, got, exact=exact, dtype=dtype)
        greedy = sample_both(monkeypatch, model, tokenizer, prompt_ids, max_new_tokens=7, greedy=True)
        assert_same_completions(*greedy, exact=exact, dtype=dtype)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_sumk_sampling_with_the_interrupt_is_transformers(monkeypatch, shape, precision):
    model, tokenizer = policy(sumk.VOCABULARY, sumk.EOS, sumk.PAD, SHAPES[shape], precision, 1)
    close_id = tokenizer.convert_tokens_to_ids(sumk.THINK_CLOSE)
    prompt_ids = tokenizer(sumk.prompt_sets(1, 48)[1], return_tensors="pt").input_ids
    rule = InterruptRule(close_id, (5, 6, close_id), low=1, high=6)
    interrupt = rule.draw(prompt_ids.shape[0], torch.Generator().manual_seed(3))
    want, got = sample_both(monkeypatch, model, tokenizer, prompt_ids, max_new_tokens=14, interrupt=interrupt)
    assert got.interrupted_B.any(), "the interrupt should fire"
    exact = RowGroups.of(prompt_ids) is None  # sumk's prompts may repeat: then they share a prefill
    assert_same_completions(want, got, exact=exact, dtype=PRECISIONS[precision][0])


def test_left_padded_prompts_take_transformers(monkeypatch):
    model, tokenizer = sort6_policy()
    _, prompts = sort6.sort6_prompt_sets(1, 8)
    prompt_ids = tokenizer(prompts, return_tensors="pt").input_ids
    mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    mask[::2, :2] = False
    calls = []
    monkeypatch.setattr(lean.LeanLlama, "extend", lambda *a, **k: calls.append(1))
    out = sample(model, prompt_ids, Sampling(max_new_tokens=5, eos_id=0, pad_id=1, prompt_mask_BP=mask, generator=torch.Generator().manual_seed(0)))  # fmt: skip
    assert not calls and out.tokens_BT.shape[0] == 8


def test_a_decoding_that_loses_the_lean_path_carries_on_in_transformers(monkeypatch):
    model, tokenizer = sort6_policy()
    _, prompts = sort6.sort6_prompt_sets(1, 16)
    prompt_ids = tokenizer(prompts, return_tensors="pt").input_ids
    assert RowGroups.of(prompt_ids) is None  # distinct prompts, no shared prefill: bit for bit

    def decode(hook_at):
        decoding = Decoding(prompt_ids, Sampling(max_new_tokens=7, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0)))  # fmt: skip
        handle = None
        while not decoding.done:
            if decoding.num_tokens == hook_at:
                handle = model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: out)
            decoding.advance(model)
        if handle is not None:
            assert lean_llama(model) is None
            handle.remove()
        return decoding

    with lean_off(monkeypatch):
        want = decode(-1).completions()
    switched = decode(3)
    assert not isinstance(switched.cache, LeanCache)  # handed over to a DynamicCache mid-way
    assert_same_completions(want, switched.completions())
    assert_same_completions(want, decode(-1).completions())


def test_what_it_cannot_reproduce_takes_the_transformers_path():
    model, _ = sort6_policy()
    assert lean_llama(model) is not None
    handle = model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: out * 2)
    assert lean_llama(model) is None
    handle.remove()
    handle = model.model.norm.register_forward_pre_hook(lambda m, a: None)
    assert lean_llama(model) is None
    handle.remove()
    assert lean_llama(model) is not None
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: out)
    assert lean_llama(model) is None
    handle.remove()
    model.model.layers[1].mlp.act_fn = torch.nn.GELU()
    assert lean_llama(model) is None
    eager, _ = sort6_policy()
    eager.config._attn_implementation = "eager"
    assert lean_llama(eager) is None
    checkpointed, _ = sort6_policy()
    checkpointed.gradient_checkpointing_enable()
    checkpointed.train()
    assert lean_llama(checkpointed) is None
    replaced, _ = sort6_policy()
    replaced.model.layers[0].self_attn.forward = lambda *a, **k: None
    assert lean_llama(replaced) is None


def count_shared_prefix_calls(monkeypatch):
    """A list that gets an entry at every call of the trainer's shared-prefix pass."""
    calls = []
    shared = lean.LeanLlama.shared_prefix_logits
    monkeypatch.setattr(lean.LeanLlama, "shared_prefix_logits", lambda *a, **k: calls.append(1) or shared(*a, **k))
    return calls


def groups_of(sizes):
    """Prompt rows in runs of the given sizes (consecutive runs differ)."""
    _, prompts = sort6.sort6_prompt_sets(1, len(sizes))
    tokenizer = build_tokenizer(sort6.VOCABULARY, eos=sort6.EOS, pad=sort6.PAD)
    ids = tokenizer(prompts, return_tensors="pt").input_ids
    return ids.repeat_interleave(torch.tensor(sizes), dim=0)


def test_row_groups_find_runs_of_equal_rows():
    uniform = RowGroups.of(groups_of([4, 4, 4]))
    assert uniform.size == 4 and uniform.first_U.tolist() == [0, 4, 8]
    assert uniform.rows_B.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    mixed = RowGroups.of(groups_of([3, 1, 2]))
    assert mixed.size is None and mixed.first_U.tolist() == [0, 3, 4]
    assert mixed.rows_B.tolist() == [0, 0, 0, 1, 2, 2]
    values = torch.arange(6.0).view(3, 2)
    assert torch.equal(mixed.spread(values), values[[0, 0, 0, 1, 2, 2]])
    assert torch.equal(uniform.spread(values), values.repeat_interleave(4, dim=0))
    assert RowGroups.of(groups_of([1, 1, 1])) is None  # nothing repeats: nothing to share
    assert RowGroups.of(groups_of([1])) is None


@pytest.mark.parametrize("sizes", [[4, 4, 4, 4], [3, 1, 5, 2]], ids=["uniform", "mixed"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_shared_prefill_is_the_whole_prefill_up_to_rounding(shape, precision, sizes):
    """Each group's prompt computed once: the whole batch's logits and cache, up to the order of
    the kernels' sums (they block by row count: bit for bit on some CPUs, not on others)."""
    model, _ = sort6_policy(shape, precision)
    ids = groups_of(sizes)
    forward = lean_llama(model)
    with torch.no_grad():
        whole = forward.new_cache()
        want = forward.extend(whole, ids, 1)
        shared = forward.new_cache(capacity=ids.shape[1] + 3)
        got = forward.prefill_shared(shared, ids, RowGroups.of(ids))
    assert_within_ulps(got, want)
    assert shared.length == whole.length == ids.shape[1]
    for index in range(len(forward.layers)):
        assert_within_ulps(shared.keys[index][:, :, : shared.length], whole.keys[index])
        assert_within_ulps(shared.values[index][:, :, : shared.length], whole.values[index])
    assert not torch.equal(got[:1].expand_as(got), got), "rows of different prompts differ"


def test_the_sampling_cache_refuses_a_position_beyond_its_capacity():
    model, _ = sort6_policy()
    forward = lean_llama(model)
    ids = groups_of([1, 1])
    cache = forward.new_cache(capacity=ids.shape[1] + 1)
    with torch.no_grad():
        forward.extend(cache, ids, 1)
        forward.extend(cache, ids[:, :1])
        with pytest.raises(ValueError, match="holds 9 positions; position 9 was written"):
            forward.extend(cache, ids[:, :1])


def test_sampled_tensors_are_ordinary_and_can_be_trained_on():
    """Sampling runs in inference mode; what it returns must still work with autograd."""
    model, tokenizer = sort6_policy()
    ids = groups_of([4, 4])
    out = sample(model, ids, Sampling(max_new_tokens=7, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0)))  # fmt: skip
    for tensor in (out.tokens_BT, out.logp_BT, out.mask_BT, out.finished_B):
        assert not tensor.is_inference()
    logp = completion_logprobs(model, ids, out.tokens_BT, shared_prefix=True)
    (logp * out.mask_BT).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# The trainer's forward and backward


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_completion_logprobs_and_gradients_are_transformers_bit_for_bit_on_one_machine(monkeypatch, shape, precision):
    model, tokenizer = sort6_policy(shape, precision)
    ids = torch.randint(0, len(tokenizer), (32, 15), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(32, 7, generator=torch.Generator().manual_seed(1))

    def once():
        model.zero_grad(set_to_none=True)
        logp = completion_logprobs(model, ids[:, :8], ids[:, 8:])
        (logp * weights).sum().backward()
        return logp.detach(), [p.grad.clone() for p in model.parameters()]

    with lean_off(monkeypatch):
        want, want_grads = once()
    got, got_grads = once()
    assert torch.equal(got, want)
    assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads, strict=True))


@pytest.mark.parametrize("num_new", [7, 1])
@pytest.mark.parametrize("sizes", [[8, 8, 8, 8], [5, 8, 2, 1]], ids=["uniform", "mixed"])
@pytest.mark.parametrize("precision", ["fp32", "fp32-head32"])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_shared_prefix_computes_the_same_logprobs_and_gradients(monkeypatch, shape, precision, sizes, num_new):
    """engine.kernels=fast: each prompt once for its group; the same function up to fp32 rounding."""
    model, tokenizer = sort6_policy(shape, precision)
    prompt_ids = groups_of(sizes)
    shape_BT = (prompt_ids.shape[0], num_new)
    tokens = torch.randint(0, len(tokenizer), shape_BT, generator=torch.Generator().manual_seed(0))
    weights = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(1))
    calls = count_shared_prefix_calls(monkeypatch)

    def once(shared_prefix):
        model.zero_grad(set_to_none=True)
        logp = completion_logprobs(model, prompt_ids, tokens, shared_prefix=shared_prefix)
        (logp * weights).sum().backward()
        return logp.detach(), [p.grad.clone() for p in model.parameters()]

    want, want_grads = once(False)
    assert not calls
    got, got_grads = once(True)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):  # each within fp32 rounding of its largest entry
        assert float((g - w).abs().max()) <= 1e-5 * float(w.abs().max())
    if num_new > 1:  # one new token: only the prompt's pass, which may well round the same
        assert any(not torch.equal(g, w) for g, w in zip(got_grads, want_grads)), "it should not be the reference path"


def test_the_lean_path_reads_weights_loaded_after_it_was_built(monkeypatch):
    model, tokenizer = sort6_policy()
    other, _ = sort6_policy(seed=5)
    ids = torch.randint(0, len(tokenizer), (8, 15), generator=torch.Generator().manual_seed(0))
    _, prompts = sort6.sort6_prompt_sets(1, 32)
    prompt_ids = tokenizer(prompts, return_tensors="pt").input_ids
    assert RowGroups.of(prompt_ids) is None  # distinct prompts, no shared prefill: bit for bit
    with torch.no_grad():
        completion_logprobs(model, ids[:, :8], ids[:, 8:])  # builds the lean forward on the old weights
    model.load_state_dict(other.state_dict())  # a checkpoint resume / TorchTrainer.load_state_dict
    with torch.no_grad():
        loaded = completion_logprobs(model, ids[:, :8], ids[:, 8:])
        assert torch.equal(loaded, completion_logprobs(other, ids[:, :8], ids[:, 8:]))
        want, got = sample_both(monkeypatch, other, tokenizer, prompt_ids, max_new_tokens=7)
    _, again = sample_both(monkeypatch, model, tokenizer, prompt_ids, max_new_tokens=7)
    assert_same_completions(got, again)
    # The generator's weight push (`TorchGenerator.load_weights`): copy_ into the state dict's tensors.
    third, _ = sort6_policy(seed=9)
    own = model.state_dict()
    with torch.no_grad():
        for name, tensor in third.state_dict().items():
            own[name].copy_(tensor)
    _, pushed = sample_both(monkeypatch, model, tokenizer, prompt_ids, max_new_tokens=7)
    _, reference = sample_both(monkeypatch, third, tokenizer, prompt_ids, max_new_tokens=7)
    assert_same_completions(pushed, reference)
    # A replaced parameter object (not an in-place load) is read too.
    model.lm_head.weight = torch.nn.Parameter(other.lm_head.weight.detach().clone())
    with torch.no_grad():
        mixed = completion_logprobs(model, ids[:, :8], ids[:, 8:])
        with lean_off(monkeypatch):
            assert torch.equal(mixed, completion_logprobs(model, ids[:, :8], ids[:, 8:]))


# ---------------------------------------------------------------------------------------------
# Whole training steps: sampling, loss, backward, clipping, AdamW


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Random tiny Llamas saved as Hugging Face directories (no warm-up: only bit-identity matters)."""
    dirs = {}
    for name, (vocabulary, eos, pad, shape) in {
        "sort6": (sort6.VOCABULARY, sort6.EOS, sort6.PAD, TinyLlamaShape()),
        "sumk": (sumk.VOCABULARY, sumk.EOS, sumk.PAD, SUMK_SMALL_SHAPE),
    }.items():
        tokenizer = build_tokenizer(vocabulary, eos=eos, pad=pad)
        model = build_tiny_llama(shape, tokenizer, seed=0)
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        dirs[name] = directory
    return dirs


def varied_reward(prompts, completions):
    """A reward that depends on the sampled text, so that a random policy gets gradients."""
    return [float(len(c.split()) % 3 == 0) for c in completions]


def step_config(model_dirs, task, overrides):
    """A few small training steps of `task` on its random tiny model (every row gets a gradient)."""
    return resolve(
        {
            "model.path": str(model_dirs[task]),
            "data.task": task,
            "data.num_train_prompts": 200,
            "data.num_valid_prompts": 8,
            "batch.prompts": 4,
            "batch.generations": 4,
            "optim.lr": 3e-3,
            "optim.warmup_steps": 0,
            "filter.zero_variance": False,
            "engine.generator": "torch",
            "engine.trainer": "torch",
        }
        | overrides
    )


def run_steps(cfg, num_steps):
    task = load_task(cfg.data)
    state = initial_state(cfg, task, generation_cap(cfg, task, lambda _: None), lambda _: None)
    state.task = dataclasses.replace(task, batch_reward=varied_reward)
    state.interrupt = interrupt_rule(cfg, task, state.tokenizer, state.max_new_tokens, lambda _: None)
    source = LocalRollouts()
    metrics = [train_step(state, source) for _ in range(num_steps)]
    return state, metrics


@pytest.mark.parametrize(
    "task, overrides",
    [
        ("sort6", {}),
        ("sort6", {"model.dtype": "bfloat16", "precision.lm_head_fp32": True}),
        ("sort6", {"model.dtype": "bfloat16", "precision.lm_head_fp32": False, "loss.type": "cispo"}),
        ("sumk", {"length.interrupt_min": 2, "length.interrupt_max": 5, "precision.lm_head_fp32": False}),
    ],
)
def test_training_steps_are_transformers_up_to_rounding(monkeypatch, model_dirs, task, overrides):
    """engine.kernels=reference against transformers: the trainer's pass is bit for bit (above),
    but sampling shares each group's prefill, whose log-probs may differ from the whole batch's in
    the last bits (see the module's docstring), and through the importance ratio so may the loss,
    the gradient and, after AdamW divides by sqrt(v), the update. The same batches, the same
    metrics up to rounding, the same weights up to `assert_same_steps_up_to_rounding`."""
    cfg = step_config(model_dirs, task, overrides)
    with lean_off(monkeypatch):
        want_state, want_metrics = run_steps(cfg, 4)
    got_state, got_metrics = run_steps(cfg, 4)
    assert lean_llama(got_state.model) is not None
    for want, got in zip(want_metrics, got_metrics, strict=True):
        assert want.keys() == got.keys()
        for key in want.keys() - {"step_seconds"}:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert_same_steps_up_to_rounding(want_state, want_metrics, got_state, got_metrics)
    initial = initial_state(cfg, load_task(cfg.data), 7, lambda _: None).model.state_dict()
    got_weights = got_state.model.state_dict()
    assert not all(torch.equal(got_weights[k], initial[k]) for k in got_weights), "the steps should have trained"


@pytest.mark.parametrize("task", ["sort6", "sumk"])
def test_fast_kernels_take_the_reference_step_up_to_rounding(monkeypatch, model_dirs, task):
    """One step of engine.kernels=fast from the same weights: the same sampled batch (sampling is
    the same in both), the same loss and gradient norm, the same update, up to fp32 rounding."""
    calls = count_shared_prefix_calls(monkeypatch)
    want_state, (want,) = run_steps(step_config(model_dirs, task, {"engine.kernels": "reference"}), 1)
    assert not calls and not want_state.trainer.optimizer.defaults["fused"]
    got_state, (got,) = run_steps(step_config(model_dirs, task, {"engine.kernels": "fast"}), 1)
    assert calls == [1] and got_state.trainer.optimizer.defaults["fused"]
    assert_same_steps_up_to_rounding(want_state, [want], got_state, [got])


def assert_same_steps_up_to_rounding(want_state, want, got_state, got):
    """The same batches (rewards), losses and gradient norms step by step, and the same weights
    at the end, up to fp32 rounding."""
    for w, g in zip(want, got, strict=True):
        assert g["reward_mean"] == w["reward_mean"] and w["grad_norm"] > 0
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-4, abs=1e-6)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4)
    lr = got_state.cfg.optim.lr
    want_weights, got_weights = want_state.model.state_dict(), got_state.model.state_dict()
    for name, weight in want_weights.items():
        torch.testing.assert_close(got_weights[name], weight, rtol=0, atol=lr * 0.05)


def count_compiled_calls(monkeypatch):
    """Per function of `recipe.model.compiled`, how many times its compiled form was called."""
    calls = {"compiled_packed_pass": 0, "compiled_decode_step": 0}

    def counting(name, real):
        def call(*args):
            calls[name] += 1
            return real()(*args)

        return lambda: call

    for name in calls:
        monkeypatch.setattr(compiled, name, counting(name, getattr(compiled, name)))
    return calls


@pytest.mark.parametrize("shape", SHAPES)
def test_a_compiled_decode_step_computes_the_lean_logits(shape):
    """engine.kernels=compiled: every decode step of a batch through torch.compile (compiled here,
    for real), the lean forward's logits and cache up to fp32 rounding."""
    model, _ = sort6_policy(shape)
    prompt_ids = groups_of([4, 4])
    lean_ = lean_llama(model)
    with torch.inference_mode():
        want_cache, got_cache = lean_.new_cache(prompt_ids.shape[1] + 7), lean_.new_cache(prompt_ids.shape[1] + 7)
        tokens = lean_.extend(want_cache, prompt_ids, 1)[:, -1].argmax(-1)
        lean_.extend(got_cache, prompt_ids, 1)
        for _ in range(7):
            want = lean_.extend(want_cache, tokens[:, None])[:, -1]
            got = lean_.decode_compiled(got_cache, tokens)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            tokens = want.argmax(-1)
        assert got_cache.length == want_cache.length
        for got_keys, want_keys in zip(got_cache.keys, want_cache.keys):
            torch.testing.assert_close(got_keys, want_keys, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="holds 15 positions"):
            lean_.decode_compiled(got_cache, tokens)


@pytest.mark.parametrize("sizes", [[8, 8, 8, 8], [5, 8, 2, 1]], ids=["uniform", "mixed"])
def test_a_compiled_pass_computes_the_same_logprobs_and_gradients(monkeypatch, sizes):
    """The trainer's pass through torch.compile: the fast pass's log-probs and gradients up to fp32
    rounding, for groups of one size and of mixed sizes."""
    model, tokenizer = sort6_policy("2-heads")
    prompt_ids = groups_of(sizes)
    tokens = torch.randint(0, len(tokenizer), (prompt_ids.shape[0], 7), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(1))
    calls = count_compiled_calls(monkeypatch)

    def once(compiled_):
        model.zero_grad(set_to_none=True)
        logp = completion_logprobs(model, prompt_ids, tokens, shared_prefix=True, compiled=compiled_)
        (logp * weights).sum().backward()
        return logp.detach(), [p.grad.clone() for p in model.parameters()]

    want, want_grads = once(False)
    assert calls["compiled_packed_pass"] == 0
    got, got_grads = once(True)
    assert calls["compiled_packed_pass"] == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert float((g - w).abs().max()) <= 1e-5 * float(w.abs().max())


def test_compiled_kernels_take_the_fast_step_up_to_rounding(monkeypatch, model_dirs):
    """Two steps of engine.kernels=compiled against fast from the same weights: both compiled
    functions in use (the decode step for the training batches only: evaluation samples as the
    other kernels do), the same batches, loss, gradient norm and update up to fp32 rounding."""
    calls = count_compiled_calls(monkeypatch)
    want_state, want = run_steps(step_config(model_dirs, "sort6", {"engine.kernels": "fast"}), 2)
    assert calls == {"compiled_packed_pass": 0, "compiled_decode_step": 0}
    got_state, got = run_steps(step_config(model_dirs, "sort6", {"engine.kernels": "compiled"}), 2)
    assert calls["compiled_packed_pass"] == 2 and calls["compiled_decode_step"] == 2 * 6
    assert got_state.trainer.optimizer.defaults["fused"]
    assert_same_steps_up_to_rounding(want_state, want, got_state, got)
    evaluated = evaluate(got_state)
    assert calls["compiled_decode_step"] == 2 * 6 and evaluated["num_samples"] > 0


def test_the_lean_forward_does_not_keep_its_model_alive():
    import gc
    import weakref

    model, _ = sort6_policy()
    assert lean_llama(model) is not None
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
