"""The sampler on a real (random) tiny Llama: EOS handling, behaviour log-probs, greedy mode."""

import pytest
import torch

from recipe.model.policy import TinyLlamaShape, build_tiny_llama, build_tokenizer, completion_logprobs
from recipe.model.sampler import InterruptRule, Sampling, decode, sample
from recipe.tasks import sort6

pytestmark = [pytest.mark.usefixtures("torch_one_thread"), pytest.mark.isa]


@pytest.fixture(scope="module")
def policy():
    tokenizer = build_tokenizer(sort6.VOCABULARY, eos=sort6.EOS, pad=sort6.PAD)
    model = build_tiny_llama(TinyLlamaShape(), tokenizer, seed=0)
    with torch.no_grad():  # make EOS likely so that sequences end at different lengths
        model.lm_head.weight[tokenizer.eos_token_id] += 0.3 * model.model.norm.weight
    return model, tokenizer


@pytest.fixture(scope="module")
def prompt_ids(policy):
    _, tokenizer = policy
    _, prompts = sort6.sort6_prompt_sets(1, 32)
    return tokenizer(prompts, return_tensors="pt").input_ids


def run(policy, prompt_ids, max_new_tokens=7, seed=0, greedy=False):
    model, tokenizer = policy
    return sample(model, prompt_ids, Sampling(max_new_tokens=max_new_tokens, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(seed), greedy=greedy))


def test_sequences_stop_at_eos_and_are_padded_after_it(policy, prompt_ids):
    _, tokenizer = policy
    out = run(policy, prompt_ids)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    lengths = out.lengths_B
    assert 1 < len(set(lengths.tolist())), "the fixture should give completions of different lengths"
    for row, mask, n, finished in zip(out.tokens_BT, out.mask_BT, lengths, out.finished_B):
        assert mask[:n].all() and not mask[n:].any()
        assert (row[n:] == pad).all()
        assert finished == (row[n - 1] == eos)
        assert not (row[: n - 1] == eos).any()
    assert (out.logp_BT[~out.mask_BT] == 0).all()
    assert (out.logp_BT[out.mask_BT] < 0).all()


def test_behaviour_logprobs_match_the_trainer_forward(policy, prompt_ids):
    model, _ = policy
    out = run(policy, prompt_ids)
    with torch.no_grad():
        trainer_logp = completion_logprobs(model, prompt_ids, out.tokens_BT)
    torch.testing.assert_close(trainer_logp[out.mask_BT], out.logp_BT[out.mask_BT], atol=1e-5, rtol=0)


def test_sampling_follows_the_untruncated_distribution(policy, prompt_ids):
    model, _ = policy
    one_prompt = prompt_ids[:1].repeat(4000, 1)
    out = run(policy, one_prompt, max_new_tokens=1, seed=1)
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=prompt_ids[:1]).logits[0, -1].float(), dim=-1)
    counts = torch.bincount(out.tokens_BT[:, 0], minlength=probs.numel()).float() / 4000
    assert (counts - probs).abs().max() < 0.03  # about 4 standard errors at p = 0.5
    assert torch.allclose(out.logp_BT[:, 0], probs.log()[out.tokens_BT[:, 0]])


def test_same_generator_seed_same_samples(policy, prompt_ids):
    first, second = run(policy, prompt_ids), run(policy, prompt_ids)
    assert torch.equal(first.tokens_BT, second.tokens_BT)
    third = run(policy, prompt_ids, seed=5)
    assert not torch.equal(first.tokens_BT, third.tokens_BT)


def test_greedy_takes_the_argmax(policy, prompt_ids):
    model, _ = policy
    out = run(policy, prompt_ids, greedy=True)
    with torch.no_grad():
        first = model(input_ids=prompt_ids).logits[:, -1].argmax(dim=-1)
    assert torch.equal(out.tokens_BT[:, 0], first)
    assert torch.equal(out.tokens_BT, run(policy, prompt_ids, greedy=True, seed=9).tokens_BT)


def test_cap_truncates_and_decode_cuts_at_the_length(policy, prompt_ids):
    _, tokenizer = policy
    out = run(policy, prompt_ids, max_new_tokens=2)
    assert out.tokens_BT.shape[1] <= 2
    texts = decode(tokenizer, out)
    assert [len(t.split()) for t in texts] == out.lengths_B.tolist()


def test_max_new_tokens_must_be_positive(policy, prompt_ids):
    with pytest.raises(ValueError, match="max_new_tokens"):
        run(policy, prompt_ids, max_new_tokens=0)


# ---------------------------------------------------------------------------------------------
# Forced interruption (length.control=interrupt), on the sumk vocabulary


@pytest.fixture(scope="module")
def thinker():
    """A random tiny Llama on sumk's symbols that never closes its thinking or ends by itself."""
    from recipe.tasks import sumk

    tokenizer = build_tokenizer(sumk.VOCABULARY, eos=sumk.EOS, pad=sumk.PAD)
    model = build_tiny_llama(TinyLlamaShape(), tokenizer, seed=1)
    close_id = tokenizer.convert_tokens_to_ids(sumk.THINK_CLOSE)
    model.logit_shift = torch.zeros(len(tokenizer))
    model.logit_shift[[close_id, tokenizer.eos_token_id]] = -30.0
    model.lm_head.register_forward_hook(lambda module, args, logits: logits + model.logit_shift)
    prompts = sumk.prompt_sets(1, 48)[1]
    return model, tokenizer, close_id, tokenizer(prompts, return_tensors="pt").input_ids


def sample_thinking(thinker, rule, seed=0, max_new_tokens=12):
    model, tokenizer, _, prompt_ids = thinker
    generator = torch.Generator().manual_seed(seed)
    interrupt = rule.draw(prompt_ids.shape[0], generator)
    out = sample(model, prompt_ids, Sampling(max_new_tokens=max_new_tokens, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, generator=generator, interrupt=interrupt))  # fmt: skip
    return interrupt.budget_B, out


def test_interrupt_fires_exactly_at_each_rows_drawn_budget(thinker):
    model, _, close_id, prompt_ids = thinker
    budgets, out = sample_thinking(thinker, InterruptRule(close_id, (close_id,), low=2, high=7))
    assert set(budgets.tolist()) == set(range(2, 8))  # drawn per row over the whole range
    assert out.interrupted_B.all()
    for row, budget in enumerate(budgets.tolist()):
        forced = out.forced_BT[row].nonzero().flatten().tolist()
        assert forced == [budget]  # one forced token, right after `budget` thinking tokens
        assert out.tokens_BT[row, budget] == close_id
        assert not (out.tokens_BT[row, :budget] == close_id).any()
    # The forced token is context: the policy's own log-prob is recorded there, as for the rest.
    with torch.no_grad():
        trainer_logp = completion_logprobs(model, prompt_ids, out.tokens_BT)
    torch.testing.assert_close(trainer_logp[out.mask_BT], out.logp_BT[out.mask_BT], atol=1e-5, rtol=0)


def test_same_seed_same_budgets_and_a_multi_token_phrase_is_forced_whole(thinker):
    _, _, close_id, _ = thinker
    rule = InterruptRule(close_id, (5, 6, close_id), low=3, high=3)
    budgets, out = sample_thinking(thinker, rule)
    again, _ = sample_thinking(thinker, rule)
    assert torch.equal(budgets, again)
    assert (out.forced_BT.nonzero()[:, 1].view(-1, 3) == torch.tensor([3, 4, 5])).all()
    assert (out.tokens_BT[:, 3:6] == torch.tensor([5, 6, close_id])).all()


def test_no_interrupt_for_rows_that_close_or_end_in_time(thinker):
    model, tokenizer, close_id, prompt_ids = thinker
    model.logit_shift[[close_id, tokenizer.eos_token_id]] = torch.tensor([1.8, 0.5])  # now it closes or ends early
    try:
        budgets, out = sample_thinking(thinker, InterruptRule(close_id, (close_id,), 4, 4))
    finally:
        model.logit_shift[[close_id, tokenizer.eos_token_id]] = -30.0
    first_four = out.tokens_BT[:, :4]
    closed_B = (first_four == close_id).any(dim=1) | (first_four == tokenizer.eos_token_id).any(dim=1)
    assert closed_B.float().mean() > 0.5
    assert torch.equal(out.interrupted_B, ~closed_B)
    assert not out.forced_BT[closed_B].any()


def test_interrupt_budgets_and_phrase_are_checked(thinker):
    _, _, close_id, prompt_ids = thinker
    with pytest.raises(ValueError, match="must end with the close token"):
        InterruptRule(close_id, (5,), 1, 2).draw(2, None)
    with pytest.raises(ValueError, match="low <= high"):
        InterruptRule(close_id, (close_id,), 3, 2)
    with pytest.raises(ValueError, match="3 interrupt budgets for 48 rows"):
        sample(thinker[0], prompt_ids, Sampling(max_new_tokens=4, eos_id=0, pad_id=0, interrupt=InterruptRule(close_id, (close_id,), 1, 2).draw(3, None)))  # fmt: skip
