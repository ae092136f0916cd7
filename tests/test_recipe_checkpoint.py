"""Checkpoint files: atomic save, newest valid on load, rotation."""

import torch

from recipe.loop import checkpoint


def state(step: int) -> dict:
    return {
        "format": checkpoint.FORMAT_VERSION,
        "step": step,
        "model": {"w": torch.full((3,), float(step))},
        "optimizer": {},
        "compute": {"flops": 1.0},
        "prompts": {},
        "pending": [],
        "rng": {"torch": torch.get_rng_state()},
        "config": {},
    }


def test_save_writes_the_named_file_and_leaves_no_temporary(tmp_path):
    path = checkpoint.save(tmp_path, 12, state(12))
    assert path == tmp_path / "checkpoints" / "step_00000012.pt"
    assert [p.name for p in path.parent.iterdir()] == ["step_00000012.pt"]
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["model"]["w"], torch.full((3,), 12.0))


def test_load_newest_valid_takes_the_newest(tmp_path):
    for step in (5, 10, 15):
        checkpoint.save(tmp_path, step, state(step))
    loaded = checkpoint.load_newest_valid(tmp_path, log=print, on_discarded=lambda s: None)
    assert loaded["step"] == 15


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous(tmp_path):
    checkpoint.save(tmp_path, 5, state(5))
    newest = checkpoint.save(tmp_path, 10, state(10))
    newest.write_bytes(newest.read_bytes()[:200])
    logs, discarded = [], []
    loaded = checkpoint.load_newest_valid(tmp_path, log=logs.append, on_discarded=discarded.append)
    assert loaded["step"] == 5
    assert discarded == [10]
    assert len(logs) == 1 and "step_00000010.pt" in logs[0]
    assert not newest.exists() and newest.with_name("step_00000010.pt.corrupt").exists()
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [5]


def test_an_incomplete_or_misnamed_checkpoint_is_not_valid(tmp_path):
    checkpoint.save(tmp_path, 1, state(1))
    incomplete = state(2)
    del incomplete["rng"]
    checkpoint.save(tmp_path, 2, incomplete)
    checkpoint.save(tmp_path, 3, state(7))  # holds another step than its name
    logs = []
    loaded = checkpoint.load_newest_valid(tmp_path, log=logs.append, on_discarded=lambda s: None)
    assert loaded["step"] == 1
    assert "step 7" in logs[0] and "missing keys ['rng']" in logs[1]


def test_no_checkpoint_means_none(tmp_path):
    assert checkpoint.load_newest_valid(tmp_path, log=print, on_discarded=lambda s: None) is None


def test_prune_keeps_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, step, state(step))
    assert checkpoint.prune(tmp_path, keep=2) == [1, 2]
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [3, 4]
    assert checkpoint.prune(tmp_path, keep=2) == []


def fitted_state(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return state(step) | {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def model_and_optimizer(width: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(width, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, width)).sum().backward()
    optimizer.step()  # so the optimizer holds per-parameter state (exp_avg, ...)
    return model, optimizer


def test_a_checkpoint_that_does_not_fit_the_model_is_skipped_like_a_corrupt_one(tmp_path):
    model, optimizer = model_and_optimizer()
    checkpoint.save(tmp_path, 5, fitted_state(5, model, optimizer))
    wider, wider_optimizer = model_and_optimizer(width=4)
    checkpoint.save(tmp_path, 10, fitted_state(10, wider, optimizer))  # weight of another shape
    missing = fitted_state(15, model, optimizer)
    del missing["model"]["bias"]
    checkpoint.save(tmp_path, 15, missing)
    checkpoint.save(tmp_path, 20, fitted_state(20, model, wider_optimizer))  # optimizer of another model
    logs, discarded = [], []
    loaded = checkpoint.load_newest_valid(
        tmp_path, log=logs.append, on_discarded=discarded.append,
        check=lambda s: checkpoint.check_fits(s, model, optimizer),
    )  # fmt: skip
    assert loaded["step"] == 5 and discarded == [20, 15, 10]
    assert "step_00000020.pt" in logs[0] and "optimizer state exp_avg of parameter 0 has shape (2, 4)" in logs[0]
    assert "step_00000015.pt" in logs[1] and "missing tensors ['bias']" in logs[1]
    assert "step_00000010.pt" in logs[2] and "weight has shape (2, 4), the model's is (2, 3)" in logs[2]
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [5]
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])  # the one kept really restores


def test_check_fits_leaves_the_model_untouched(tmp_path):
    model, optimizer = model_and_optimizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrong = fitted_state(1, model, optimizer)
    wrong["model"] = {"weight": torch.zeros(2, 3), "bias": torch.zeros(5)}
    try:
        checkpoint.check_fits(wrong, model, optimizer)
    except ValueError as exc:
        assert "bias has shape (5,)" in str(exc)
    else:
        raise AssertionError("a misfit state passed check_fits")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
