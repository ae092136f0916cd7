"""The evaluation schedule (`EvalConfig.evaluates`, recipe/config.py): denser evals early on."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.yamlfile import load_file
from recipe.config import ConfigError, resolve


def _steps(overrides: dict, last: int = 400) -> list[int]:
    cfg = resolve(overrides)
    return [s for s in range(last + 1) if cfg.eval.evaluates(s)]


def test_early_evals_every_early_every_steps_before_early_until():
    dense = {"eval.every": 50, "eval.log_spaced": False, "eval.early_every": 10, "eval.early_until": 100}
    assert _steps(dense, 300) == [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 150, 200, 250, 300]
    # with log spacing too: the union (powers of two below `every`)
    both = {**dense, "eval.log_spaced": True, "eval.early_every": 30}
    assert _steps(both, 200) == [0, 1, 2, 4, 8, 16, 30, 32, 50, 60, 90, 100, 150, 200]
    assert _steps({"eval.every": 100, "eval.log_spaced": False}) == [0, 100, 200, 300, 400]


def test_the_built_in_studies_call_the_first_quarter_with_enough_points():
    root = Path(__file__).resolve().parents[1] / "sweeps"
    for name in ("quickstart.yaml", "sumk-knobs.yaml", "scalerl-loo.yaml"):
        doc = load_file(root / name)
        flat = {f"eval.{k}": v for k, v in doc["recipe"]["eval"].items()}
        steps = doc["budget"]["steps"]
        early = [s for s in _steps(flat, steps) if s <= steps // 4]
        assert len(early) >= 12, (name, early)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [({"eval.early_every": 10}, "eval.early_until"), ({"eval.early_every": 0, "eval.early_until": 100}, "eval.early_every")],
)
def test_a_bad_early_schedule_names_its_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        resolve(overrides)
    assert info.value.key == key
