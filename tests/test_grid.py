"""Grid loading, validation and expansion (launcher/grid.py)."""

from __future__ import annotations

from collections import Counter

import pytest

from launcher.grid import GridError, expand, load_sweep, run_id
from recipe.config import RecipeConfig

DESIGN_EXAMPLE = """
name: scalerl-loo
grid:
  loss.type: [cispo, dapo]
  loss.aggregation: [prompt, sample, token]
zip:
  - {batch.prompts: [32, 48, 128], batch.generations: [16, 16, 16]}
ablate:
  async.mode: ppo-offpolicy
  loss.type: dapo
  advantage.norm: prompt
seeds: [0, 1, 2]
exclude: [{loss.type: dapo, loss.aggregation: token}]
budget: {gpu_hours: 16000}
"""


def test_cartesian_grid_times_seeds(sweep_file):
    spec = load_sweep(
        sweep_file(
            "name: g\ngrid:\n  loss.type: [cispo, grpo]\n  advantage.norm: [batch, prompt, none]\nseeds: [0, 1]\n"
        )
    )
    plans = expand(spec)
    assert len(plans) == 2 * 3 * 2
    assert {(p.axes["loss.type"], p.axes["advantage.norm"], p.axes["seed"]) for p in plans} == {
        (lt, an, s) for lt in ("cispo", "grpo") for an in ("batch", "prompt", "none") for s in (0, 1)
    }
    assert all(p.config.seed == p.axes["seed"] for p in plans)


def test_zip_advances_axes_together(sweep_file):
    spec = load_sweep(sweep_file("name: z\nzip:\n  - {batch.prompts: [4, 8, 16], batch.generations: [16, 8, 4]}\n"))
    pairs = [(p.config.batch.prompts, p.config.batch.generations) for p in expand(spec)]
    assert pairs == [(4, 16), (8, 8), (16, 4)]


def test_design_example_counts(sweep_file):
    """DESIGN.md's example: 2x3 grid x 3 zip positions = 18 points, minus 3 excluded = 15; each
    point plus its ablations (async and advantage always new; loss.type=dapo lands on a grid
    point or on an excluded one), x 3 seeds."""
    plans = expand(load_sweep(sweep_file(DESIGN_EXAMPLE)))
    assert len(plans) == (15 + 15 + 15) * 3
    assert Counter(p.axes["ablate"] for p in plans) == {
        "base": 45,
        "async.mode=ppo-offpolicy": 45,
        "advantage.norm=prompt": 45,
    }
    assert not any(p.config.loss.type == "dapo" and p.config.loss.aggregation == "token" for p in plans)
    assert all(p.config.budget.gpu_hours == 16000 and p.config.budget.steps is None for p in plans)


def test_ablate_without_grid_is_leave_one_out_around_the_base(sweep_file):
    spec = load_sweep(
        sweep_file("name: loo\nablate:\n  loss.type: grpo\n  filter.zero_variance: false\n  advantage.norm: batch\n")
    )
    plans = expand(spec)
    # advantage.norm=batch is already the base: that ablation is the base run itself
    assert [p.axes["ablate"] for p in plans] == ["base", "loss.type=grpo", "filter.zero_variance=False"]


def test_ablate_list_form_changes_several_keys_at_once(sweep_file):
    spec = load_sweep(sweep_file("name: multi\nablate:\n  - {loss.type: dapo, loss.clip_high: 0.3}\n"))
    plans = expand(spec)
    assert len(plans) == 2
    assert (plans[1].config.loss.type, plans[1].config.loss.clip_high) == ("dapo", 0.3)


def test_exclude_drops_matching_points(sweep_file):
    spec = load_sweep(
        sweep_file(
            "name: ex\ngrid:\n  loss.type: [cispo, grpo]\n  batch.prompts: [4, 8]\nexclude:\n  - {loss.type: grpo, batch.prompts: 8}\n"
        )
    )
    assert sorted((p.config.loss.type, p.config.batch.prompts) for p in expand(spec)) == [
        ("cispo", 4),
        ("cispo", 8),
        ("grpo", 4),
    ]


def test_no_axes_means_one_run_of_the_base_recipe(sweep_file):
    plans = expand(load_sweep(sweep_file("name: one\nrecipe:\n  optim: {lr: 3.0e-4}\n")))
    assert len(plans) == 1 and plans[0].config.optim.lr == 3e-4 and plans[0].axes == {}


def test_identical_resolved_configs_are_one_run(sweep_file):
    # the grid value 48 is the default, so the two recipes resolve identically
    spec = load_sweep(sweep_file("name: dup\nzip:\n  - {batch.prompts: [48, 48], optim.lr: [5.0e-7, 5.0e-7]}\n"))
    assert len(expand(spec)) == 1


def test_run_ids_are_stable_and_depend_on_config_not_budget(sweep_file):
    a = expand(load_sweep(sweep_file("name: s\ngrid:\n  loss.type: [cispo, grpo]\nbudget: {steps: 10}\n")))
    b = expand(load_sweep(sweep_file("name: s\ngrid:\n  loss.type: [cispo, grpo, dapo]\nbudget: {steps: 99}\n")))
    assert [p.id for p in a] == [p.id for p in b[:2]]
    assert len({p.id for p in b}) == 3
    assert a[0].id == run_id("s", a[0].config) and len(a[0].id) == 12
    assert run_id("other", a[0].config) != a[0].id


def test_command_line_overrides_edit_the_sweep_file(sweep_file):
    spec = load_sweep(
        sweep_file("name: o\ngrid:\n  loss.type: [cispo]\nbudget: {steps: 100}\n"),
        ["budget.steps=7", "seeds=[3,4]", "recipe.optim.lr=0.001"],
    )
    plans = expand(spec)
    assert [p.config.seed for p in plans] == [3, 4]
    assert all(p.config.budget.steps == 7 and p.config.optim.lr == 0.001 for p in plans)


def test_budget_replaces_the_recipe_budget(sweep_file):
    (plan,) = expand(load_sweep(sweep_file("name: b\nbudget: {flops: 1.0e12}\n")))
    assert plan.budget == {"steps": None, "gpu_hours": None, "flops": 1e12}


# -- errors: exact messages ------------------------------------------------------------------


def _error(sweep_file, text: str, overrides=()) -> str:
    path = sweep_file(text)
    with pytest.raises(GridError) as info:
        expand(load_sweep(path, overrides))
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    return message[len(f"{path}: ") :]


def test_misspelled_grid_key_names_key_and_closest_match(sweep_file):
    assert _error(sweep_file, "name: t\ngrid:\n  loss.agregation: [prompt, token]\n") == (
        "grid.loss.agregation: unknown key 'loss.agregation' (did you mean 'loss.aggregation'?); "
        "allowed keys: loss.aggregation, loss.clip_high, loss.clip_low, loss.eps_max, loss.gspo_clip_high, "
        "loss.gspo_clip_low, loss.type"
    )


def test_bad_value_names_allowed_values_and_closest(sweep_file):
    assert _error(sweep_file, "name: t\ngrid:\n  loss.type: [cispo, dpo]\n") == (
        "grid.loss.type: invalid value 'dpo'; allowed: one of 'cispo', 'dapo', 'gspo', 'grpo' (did you mean 'dapo'?)"
    )


def test_wrong_type_and_range(sweep_file):
    assert (
        _error(sweep_file, "name: t\nrecipe:\n  batch: {prompts: many}\n")
        == "recipe.batch.prompts: invalid value 'many'; expected int"
    )
    assert (
        _error(sweep_file, "name: t\ngrid:\n  batch.generations: [1, 8]\n")
        == "grid.batch.generations: invalid value 1; must be >= 2"
    )


def test_unknown_top_level_key(sweep_file):
    assert _error(sweep_file, "name: t\ngrids:\n  loss.type: [cispo]\n").startswith(
        "grids: unknown key (did you mean 'grid'?); allowed: name, description, recipe, grid"
    )


def test_nested_recipe_key_typo(sweep_file):
    assert _error(sweep_file, "name: t\nrecipe:\n  optim: {learning_rate: 0.1}\n").startswith(
        "recipe.optim.learning_rate: unknown key 'optim.learning_rate'"
    )


def test_unsafe_sweep_name(sweep_file):
    assert _error(sweep_file, "name: ../etc\n").startswith("name: invalid sweep name '../etc'")
    assert _error(sweep_file, "name: 'a b;rm -rf'\n").startswith("name: invalid sweep name 'a b;rm -rf'")


def test_zip_lengths_must_match(sweep_file):
    assert _error(sweep_file, "name: t\nzip:\n  - {batch.prompts: [4, 8], batch.generations: [4]}\n") == (
        "zip[0]: zipped axes must have equal lengths, got {'batch.prompts': 2, 'batch.generations': 1}"
    )


def test_axis_in_grid_and_zip_is_refused(sweep_file):
    assert _error(sweep_file, "name: t\ngrid:\n  batch.prompts: [4]\nzip:\n  - {batch.prompts: [8]}\n").startswith(
        "zip[0].batch.prompts: this key is already an axis"
    )


def test_cross_field_error_names_the_run(sweep_file):
    message = _error(sweep_file, "name: t\ngrid:\n  length.interrupt_max: [100, 20000]\n")
    assert (
        message
        == "length.interrupt_max: 100 is below length.interrupt_min=10240 (in the run with length.interrupt_max=100)"
    )


def test_override_typo_is_caught(sweep_file):
    assert _error(sweep_file, "name: t\n", ["budget.stpes=5"]).startswith(
        "budget.stpes: unknown key (did you mean 'steps'?)"
    )


def test_missing_file():
    with pytest.raises(GridError, match="nope.yaml: file: no such file"):
        load_sweep("nope.yaml")


def test_base_recipe_default_is_scalerl():
    cfg = RecipeConfig()
    assert (cfg.loss.type, cfg.loss.aggregation, cfg.advantage.norm, cfg.async_.mode, cfg.async_.max_lag) == (
        "cispo", "prompt", "batch", "pipeline", 8,
    )  # fmt: skip
    assert (cfg.batch.prompts, cfg.batch.generations, cfg.optim.lr, cfg.optim.eps) == (48, 16, 5e-7, 1e-15)


def test_config_yaml_is_what_pyyaml_writes_and_renders_each_section_once(monkeypatch):
    """The run files' YAML is rendered a section at a time and memoised: the text must be exactly
    yaml.dump's, and a second config that differs in one section must render only that one."""
    from pathlib import Path

    import yaml

    import recipe.config as config_module
    from recipe.config import config_yaml

    sweeps = sorted(Path(__file__).resolve().parents[1].glob("sweeps/*.yaml"))
    assert sweeps
    configs = [plan.config.to_dict() for path in sweeps for plan in expand(load_sweep(path))]
    for config in configs:
        assert config_yaml(config) == yaml.dump(config, Dumper=yaml.SafeDumper, sort_keys=False)

    monkeypatch.setattr(config_module, "_SECTION_YAML", {})
    rendered: list[str] = []
    real_dump = yaml.dump
    monkeypatch.setattr(yaml, "dump", lambda data, **kw: rendered.append(next(iter(data))) or real_dump(data, **kw))
    base = RecipeConfig().to_dict()
    config_yaml(base)
    assert rendered == list(base)
    rendered.clear()
    changed = {**base, "optim": {**base["optim"], "lr": 1.0e-3}}
    text = config_yaml(changed)
    assert rendered == ["optim"]
    assert "lr: 0.001" in text and text == real_dump(changed, Dumper=yaml.SafeDumper, sort_keys=False)
