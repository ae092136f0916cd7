"""The torch generator on a real tiny Llama: blocking generation equals the sampler, behaviour
log-probs equal the trainer's, a push over a real gloo weight group takes (checksums, greedy
outputs), and sequences in flight continue on the new weights and record both versions."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from recipe.engines.torch_generator import TorchGenerator
from recipe.engines.weights import TorchWeightSender, WeightGroupSpec, weight_checksums, weight_meta
from recipe.model.policy import TinyLlamaShape, build_tiny_llama, completion_logprobs
from recipe.model.sampler import Sampling, sample
from recipe.pipeline.rendezvous import free_port
from recipe.tasks import sort6

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def policy(tokenizer, seed: int = 0):
    model = build_tiny_llama(TinyLlamaShape(), tokenizer, seed=seed)
    with torch.no_grad():  # EOS likely enough that sequences end at different lengths
        model.lm_head.weight[tokenizer.eos_token_id] += 0.3 * model.model.norm.weight
    return model


def prompts(tokenizer, num: int = 3) -> list[list[int]]:
    _, texts = sort6.sort6_prompt_sets(1, num)
    return tokenizer(texts).input_ids


def generator(model, tokenizer, **kwargs) -> TorchGenerator:
    return TorchGenerator(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, **kwargs)


def test_blocking_generation_is_the_sampler_and_its_logprobs_the_trainers(tokenizer):
    model = policy(tokenizer)
    rows = prompts(tokenizer)
    groups = generator(model, tokenizer).generate(rows, num_samples=4, max_new_tokens=7, seed=5)
    expected = sample(model, torch.tensor(rows).repeat_interleave(4, dim=0), Sampling(max_new_tokens=7, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(5)))
    samples = [s for group in groups for s in group]
    assert [list(s.token_ids) for s in samples] == [
        row[:n] for row, n in zip(expected.tokens_BT.tolist(), expected.lengths_B.tolist())
    ]
    assert len({len(s.token_ids) for s in samples}) > 1
    assert all(s.version_start == s.version_end == 0 for s in samples)
    # the trainer's log-prob of each sampled token, on the same weights: the ratio is 1
    for prompt, group in zip(rows, groups):
        for s in group:
            trainer = completion_logprobs(model, torch.tensor([prompt]), torch.tensor([s.token_ids]))[0]
            torch.testing.assert_close(torch.tensor(s.logprobs), trainer.detach(), rtol=0, atol=1e-5)


def test_sequences_in_flight_continue_on_pushed_weights_and_record_both_versions(tokenizer):
    model = policy(tokenizer)
    gen = generator(model, tokenizer, chunk_tokens=2)
    rows = prompts(tokenizer, 2)
    gen.submit("a", rows[0], num_samples=8, max_new_tokens=7, seed=1)
    gen.submit("b", rows[1], num_samples=8, max_new_tokens=7, seed=2)
    finished = gen.poll(timeout_s=0.0)  # two tokens each: most sequences are still running
    assert gen.num_running == 2 - len(finished)
    uniform = policy(tokenizer)
    with torch.no_grad():  # version 1 samples every token uniformly: log-prob -log(V) exactly
        uniform.lm_head.weight.zero_()
    gen.load_weights(uniform.state_dict().items(), version=1)
    while gen.num_running:
        finished += gen.poll(timeout_s=1.0)
    samples = [s for group in finished for s in group.samples]
    assert sorted(g.group_id for g in finished) == ["a", "b"]
    uniform_logp = -math.log(uniform.config.vocab_size)
    spanning = [s for s in samples if s.version_end == 1]
    assert spanning, "some sequence should have been running across the push"
    for s in samples:
        assert s.version_start == 0
        assert all(abs(lp - uniform_logp) > 1e-3 for lp in s.logprobs[:2])  # the old weights' tokens
        if s.version_end == 1:  # every token after the push comes from the new weights
            assert len(s.token_ids) > 2
            assert s.logprobs[2:] == pytest.approx([uniform_logp] * (len(s.token_ids) - 2), abs=1e-5)
        else:
            assert len(s.token_ids) <= 2 and s.finished
    assert gen.num_generated_tokens == sum(len(s.token_ids) for s in samples)


def test_a_push_over_the_weight_group_takes(tokenizer):
    trained = policy(tokenizer, seed=1)
    gen = generator(policy(tokenizer, seed=0), tokenizer)
    rows = prompts(tokenizer, 4)
    before = gen.generate(rows, num_samples=1, max_new_tokens=7, seed=0, greedy=True)
    spec = WeightGroupSpec(host="127.0.0.1", port=free_port(), num_generators=1, timeout_s=60)
    weights = list(trained.state_dict().items())
    errors: list[BaseException] = []

    def trainer_rank_0() -> None:
        try:
            sender = TorchWeightSender(spec)
            sender.push(weights, version=1)
            sender.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    thread = threading.Thread(target=trainer_rank_0)
    thread.start()
    gen.join_weight_group(spec, generator_index=0)
    gen.receive_weights(1, weight_meta(weights))
    thread.join(timeout=60)
    assert not errors and not thread.is_alive()
    assert gen.version == 1
    assert weight_checksums(gen.model.state_dict().items()) == weight_checksums(weights)
    after = gen.generate(rows, num_samples=1, max_new_tokens=7, seed=0, greedy=True)
    reference = generator(trained, tokenizer).generate(rows, num_samples=1, max_new_tokens=7, seed=0, greedy=True)
    assert [s.token_ids for g in after for s in g] == [s.token_ids for g in reference for s in g]
    assert [s.token_ids for g in after for s in g] != [s.token_ids for g in before for s in g]


def test_a_streamed_group_with_thinking_budgets_is_interrupted_as_the_sampler_does_and_records_forced_positions(
    tokenizer,
):
    from recipe.model.sampler import Interrupt
    from recipe.pipeline.transport import group_from_wire, group_to_wire, interrupt_from_wire, interrupt_to_wire

    model = policy(tokenizer)
    vocab = tokenizer.get_vocab()
    close_id = vocab[sort6.VOCABULARY[-1]]  # any token plays the end of thinking here
    phrase = (vocab[sort6.VOCABULARY[0]], close_id)
    budgets = torch.tensor([0, 1, 3, 50])  # 50: beyond the cap, never interrupted
    interrupt = interrupt_from_wire(interrupt_to_wire(Interrupt(close_id, phrase, budgets)))  # as it travels
    gen = generator(model, tokenizer, chunk_tokens=2)
    row = prompts(tokenizer, 1)[0]
    gen.submit("g", row, num_samples=4, max_new_tokens=7, seed=3, interrupt=interrupt)
    finished = []
    while gen.num_running:
        finished += gen.poll(timeout_s=1.0)
    (group,) = [group_from_wire(group_to_wire(g)) for g in finished]
    expected = sample(
        model, torch.tensor([row]).repeat_interleave(4, dim=0),
        Sampling(max_new_tokens=7, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                 generator=torch.Generator().manual_seed(3), interrupt=interrupt),
    )  # fmt: skip
    lengths = expected.lengths_B.tolist()
    for s, tokens, forced, n, budget in zip(
        group.samples, expected.tokens_BT.tolist(), expected.forced_BT.tolist(), lengths, budgets.tolist()
    ):
        assert list(s.token_ids) == tokens[:n]
        assert s.forced == tuple(i for i, f in enumerate(forced[:n]) if f)
        if budget < n and close_id not in s.token_ids[:budget]:  # still thinking at its budget: the phrase follows
            assert s.forced[0] == budget and s.token_ids[budget : budget + len(phrase)] == phrase[: n - budget]
    assert group.samples[0].forced[:1] == (0,)  # budget 0: the phrase comes first
    assert group.samples[3].forced == ()
