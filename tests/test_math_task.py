"""The math-jsonl task: the shipped sample, data checks, the split, chat prompts, the reward, and
a tiny model trained on it end to end (train loop, and the `sweep` CLI's local executor)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from recipe.config import ConfigError, resolve
from recipe.tasks.math import score as rmath
from recipe.tasks.math.data import MathDataError, check_math_data, read_math_jsonl
from recipe.tasks.math.sample import SAMPLE_PATH, sample_jsonl
from recipe.tasks.task import load_task, render_chat_prompt

pytestmark = pytest.mark.usefixtures("math_pool")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from math_tiny import build_math_tiny

    return build_math_tiny(tmp_path_factory.mktemp("math-tiny"))


def write_jsonl(tmp_path: Path, lines: list[str], name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def row(prompt: str, answer: str) -> str:
    return json.dumps({"prompt": prompt, "answer": answer})


# ---------------------------------------------------------------------------------------------
# The sample and the data checks


def test_the_shipped_sample_is_what_the_generator_writes():
    assert SAMPLE_PATH.read_text() == sample_jsonl()


def test_the_shipped_sample_passes_the_launch_check_and_each_gold_scores_itself():
    assert check_math_data(SAMPLE_PATH) == 64
    rows = read_math_jsonl(SAMPLE_PATH)
    pairs = [(f"<think>hm</think> \\boxed{{{r.answer}}}", r.answer) for r in rows]
    assert rmath.score_math_batch(pairs) == [1.0] * len(rows)


@pytest.mark.parametrize(
    ("lines", "line", "words"),
    [
        ([row("a", "1"), "{not json", row("b", "2")], 2, ["not valid JSON"]),
        ([row("a", "1"), "[1, 2]"], 2, ["JSON object"]),
        ([row("a", "1"), '{"prompt": "b", "anwser": "2"}'], 2, ["no 'answer' field", "did you mean 'anwser'?"]),
        ([row("a", "1"), '{"problem": "b", "answer": "2"}'], 2, ["no 'prompt' field"]),
        ([row("", "1")], 1, ["'prompt' must be a non-empty string"]),
        (['{"prompt": "a", "answer": null}'], 1, ["'answer' must be"]),
        ([row("a", "1"), "", row("b", "\\frac{1}{")], 3, ["unbalanced braces"]),
        ([row("a", "1"), row("b", "   ")], 2, ["'answer' must be"]),
        ([row("a", "1"), row("a", "2")], 2, ["repeats the prompt of line 1"]),
    ],
)
def test_bad_rows_are_named_by_file_and_line(tmp_path, lines, line, words):
    path = write_jsonl(tmp_path, lines)
    with pytest.raises(MathDataError) as caught:
        check_math_data(path)
    message = caught.value.detail
    assert caught.value.key == "data.train" and str(caught.value) == f"data.train: {message}"
    assert message.startswith(f"{path}:{line}: ") and "\n" not in message
    for word in words:
        assert word in message


def test_a_missing_or_empty_file_is_named(tmp_path):
    with pytest.raises(MathDataError, match="no such file"):
        check_math_data(tmp_path / "nope.jsonl")
    with pytest.raises(MathDataError, match="no rows"):
        check_math_data(write_jsonl(tmp_path, ["", "  "]))


def test_numbers_as_answers_are_accepted(tmp_path):
    path = write_jsonl(tmp_path, ['{"prompt": "a", "answer": 3}', '{"prompt": "b", "answer": 0.5, "extra": 1}'])
    assert check_math_data(path) == 2
    assert [r.answer for r in read_math_jsonl(path)] == ["3", "0.5"]


# ---------------------------------------------------------------------------------------------
# The task


def math_config(train: Path, valid: Path, **overrides):
    """A math-jsonl recipe; the model is any Hugging Face directory (a built-in model serves its own
    task only, and the task under test never opens it)."""
    keys = {"model.path": "/models/any-hf-model", "data.task": "math-jsonl", "data.train": str(train), "data.valid": str(valid)}
    return resolve(keys | overrides)


def test_one_file_splits_into_disjoint_held_out_and_train_rows():
    task = load_task(math_config(SAMPLE_PATH, SAMPLE_PATH, **{"data.num_valid_prompts": 16}).data)
    assert (len(task.valid_prompts), len(task.train_prompts)) == (16, 48)
    assert not set(task.valid_prompts) & set(task.train_prompts)
    again = load_task(math_config(SAMPLE_PATH, SAMPLE_PATH, **{"data.num_valid_prompts": 16}).data)
    assert again.valid_prompts == task.valid_prompts  # the same on every machine


def test_separate_files_and_the_row_caps(tmp_path):
    train = write_jsonl(tmp_path, [row(f"t{i}", str(i)) for i in range(10)], "train.jsonl")
    valid = write_jsonl(tmp_path, [row(f"v{i}", str(i)) for i in range(5)], "valid.jsonl")
    task = load_task(math_config(train, valid, **{"data.num_train_prompts": 7, "data.num_valid_prompts": 3}).data)
    assert len(task.train_prompts) == 7 and all(p.startswith("t") for p in task.train_prompts)
    assert len(task.valid_prompts) == 3 and all(p.startswith("v") for p in task.valid_prompts)
    task = load_task(math_config(train, valid).data)  # caps above the file sizes: every row
    assert (len(task.train_prompts), len(task.valid_prompts)) == (10, 5)


def test_a_held_out_set_that_leaves_nothing_to_train_on_is_refused():
    with pytest.raises(ConfigError, match="data.num_valid_prompts"):
        load_task(math_config(SAMPLE_PATH, SAMPLE_PATH, **{"data.num_valid_prompts": 64}).data)


def test_a_bad_file_is_a_config_error_naming_the_key(tmp_path):
    bad = write_jsonl(tmp_path, ["{oops"])
    with pytest.raises(ConfigError) as caught:
        load_task(math_config(bad, SAMPLE_PATH).data)
    assert caught.value.key == "data.train" and f"{bad}:1:" in str(caught.value)


def test_the_reward_scores_the_box_after_the_thinking():
    task = load_task(math_config(SAMPLE_PATH, SAMPLE_PATH, **{"data.num_valid_prompts": 8}).data)
    prompt = task.train_prompts[0]
    answer = {r.prompt: r.answer for r in read_math_jsonl(SAMPLE_PATH)}[prompt]
    # The prompt opened the thinking block: the completion starts inside it.
    completions = [
        f"let me see</think>The answer is \\boxed{{{answer}}}.</s>",
        f"maybe \\boxed{{{answer}}}</s>",  # never left the thinking block
        f"maybe \\boxed{{{answer}}}</think> so: \\boxed{{123456}}</s>",
        "no idea</think> pass</s>",
    ]
    assert task.score([prompt] * 4, completions) == [1.0, 0.0, 0.0, 0.0]
    assert task.reward(prompt, completions[0]) == 1.0


def test_chat_prompts_end_inside_an_open_thinking_block(tiny_dir):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_dir)
    text = render_chat_prompt(tokenizer, "What is 2+2?")
    assert text == "<|user|>What is 2+2?</s><|assistant|><think>"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.convert_ids_to_tokens(ids[-1]) == "<think>"
    # A template that leaves the thinking block to the model (Qwen3's) gets it opened here.
    tokenizer.chat_template = "{% for m in messages %}U:{{ m['content'] }}{% endfor %}A:"
    assert render_chat_prompt(tokenizer, "hi") == "U:hiA:<think>\n"
    tokenizer.chat_template = None
    with pytest.raises(ConfigError, match="no chat template"):
        render_chat_prompt(tokenizer, "hi")


def test_prompts_of_different_lengths_are_left_padded_with_a_mask(tiny_dir):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_dir)
    task = load_task(math_config(SAMPLE_PATH, SAMPLE_PATH, **{"data.num_valid_prompts": 8}).data)
    ids, mask = task.encode(tokenizer, task.valid_prompts)
    assert mask is not None and ids.shape == mask.shape
    lengths = mask.sum(dim=1)
    assert lengths.min() < lengths.max()
    assert bool(mask[:, -1].all())  # padded on the left: every prompt ends in the last column
    assert bool((ids[~mask] == tokenizer.pad_token_id).all())


# ---------------------------------------------------------------------------------------------
# End to end


def small_math_config(model_dir: Path, **overrides):
    flat = {
        "model.path": str(model_dir),
        "data.task": "math-jsonl",
        "data.train": str(SAMPLE_PATH),
        "data.valid": str(SAMPLE_PATH),
        "data.num_valid_prompts": 8,
        "length.control": "none",
        "length.max_new_tokens": 24,
        "batch.prompts": 4,
        "batch.generations": 2,
        "filter.zero_variance": False,  # reward ~0: keep the groups so the update path runs
        "optim.lr": 1e-3,
        "eval.every": 2,
        "eval.samples": 2,
        "checkpoint.every": 2,
        "budget.steps": 3,
        "engine.generator": "torch",
        "engine.trainer": "torch",
    }
    return resolve(flat | overrides)


@pytest.mark.usefixtures("torch_one_thread")
def test_a_tiny_model_trains_on_the_sample_and_writes_eval_points(tiny_dir, tmp_path):
    from recipe.loop.train import train
    from recipe.telemetry.sinks import MemorySink

    sink = MemorySink()
    outcome = train(small_math_config(tiny_dir), tmp_path / "run", sink, log=lambda _: None)
    assert (outcome.state, outcome.final_step) == ("completed", 3)
    points = [sink.eval_points[step] for step in sorted(sink.eval_points)]
    assert [p["step"] for p in points] == [0, 1, 2, 3]
    assert all(0.0 <= p["pass_rate"] <= 1.0 and p["num_samples"] == 16 for p in points)
    assert all(p["metrics"]["mean_length"] > 0 for p in points)
    assert points[-1]["flops"] > 0 and math.isfinite(points[-1]["metrics"]["train_loss"])


@pytest.mark.slow
def test_a_math_sweep_runs_through_the_local_executor(tiny_dir, sweep_file, sqlite_url):
    from click.testing import CliRunner

    from launcher.cli import cli

    grid = sweep_file(
        f"""\
name: mathtiny
recipe:
  model: {{path: "{tiny_dir}"}}
  data: {{task: math-jsonl, train: "{SAMPLE_PATH}", valid: "{SAMPLE_PATH}", num_valid_prompts: 8}}
  length: {{control: none, max_new_tokens: 24}}
  batch: {{prompts: 4, generations: 2}}
  filter: {{zero_variance: false}}
  eval: {{every: 2, samples: 2}}
  checkpoint: {{every: 2}}
  engine: {{generator: torch, trainer: torch}}
grid:
  loss.type: [cispo]
budget: {{steps: 3}}
"""
    )
    result = CliRunner().invoke(
        cli, ["--db", sqlite_url, "launch", str(grid), "--cluster", "local", "--wait"], terminal_width=200
    )
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(cli, ["--db", sqlite_url, "status", "--json"], terminal_width=200)
    (run,) = json.loads(result.output)["runs"]
    assert (run["state"], run["step"]) == ("completed", 3), run
    assert 0.0 <= run["pass_rate"] <= 1.0
