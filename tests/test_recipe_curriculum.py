"""Prompt drawing: epochs without replacement, No-Positive-Resampling, resumable state."""

import numpy as np
import pytest

from recipe.loop.curriculum import PromptDrawer


def test_an_epoch_visits_every_prompt_once():
    drawer = PromptDrawer(12, seed=0)
    seen = np.concatenate([drawer.draw(4) for _ in range(3)])
    assert sorted(seen.tolist()) == list(range(12))
    assert drawer.epoch == 1


def test_a_batch_that_does_not_fit_starts_a_new_epoch_without_duplicates():
    drawer = PromptDrawer(10, seed=0)
    drawer.draw(4)
    drawer.draw(4)
    batch = drawer.draw(4)  # only 2 left in epoch 1
    assert drawer.epoch == 2 and len(set(batch.tolist())) == 4


def test_retired_prompts_are_never_drawn_again():
    drawer = PromptDrawer(10, seed=1)
    first = drawer.draw(5)
    drawer.retire(first[:3])
    later = np.concatenate([drawer.draw(3) for _ in range(10)])
    assert not set(later.tolist()) & set(first[:3].tolist())
    assert drawer.num_active == 7


def test_retiring_skips_the_rest_of_the_current_epoch_too():
    drawer = PromptDrawer(8, seed=2)
    drawer.draw(2)
    upcoming = drawer.order[2:4]
    drawer.retire(upcoming)
    assert not set(drawer.draw(2).tolist()) & set(upcoming.tolist())


def test_drawing_more_than_remain_is_an_error():
    drawer = PromptDrawer(5, seed=0)
    drawer.retire(np.arange(3))
    with pytest.raises(ValueError, match="only 2 remain"):
        drawer.draw(3)


def test_state_dict_resumes_the_same_sequence():
    drawer = PromptDrawer(50, seed=3)
    for _ in range(4):
        drawer.draw(7)
    drawer.retire(np.array([1, 2, 3]))
    clone = PromptDrawer(50, seed=999)
    clone.load_state_dict(drawer.state_dict())
    for _ in range(20):
        assert drawer.draw(7).tolist() == clone.draw(7).tolist()
