"""The sampler on a real (random) tiny Llama: EOS handling, behaviour log-probs, greedy mode."""

import pytest
import torch

from recipe import tasks
from recipe.model import TinyLlamaShape, build_tiny_llama, build_tokenizer, completion_logprobs
from recipe.sampler import decode, sample

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def policy():
    tokenizer = build_tokenizer(tasks.VOCABULARY, eos=tasks.EOS, pad=tasks.PAD)
    model = build_tiny_llama(TinyLlamaShape(), tokenizer, seed=0)
    with torch.no_grad():  # make EOS likely so that sequences end at different lengths
        model.lm_head.weight[tokenizer.eos_token_id] += 0.3 * model.model.norm.weight
    return model, tokenizer


@pytest.fixture(scope="module")
def prompt_ids(policy):
    _, tokenizer = policy
    _, prompts = tasks.sort6_prompt_sets(1, 32)
    return tokenizer(prompts, return_tensors="pt").input_ids


def run(policy, prompt_ids, max_new_tokens=7, seed=0, greedy=False):
    model, tokenizer = policy
    return sample(
        model,
        prompt_ids,
        max_new_tokens=max_new_tokens,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(seed),
        greedy=greedy,
    )


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
