"""Which training prompts a step sees: epochs without replacement, and No-Positive-Resampling.

Each epoch is a fresh random order of the prompts still in the training set. A prompt whose
pass rate in one of its groups reaches `filter.npr_threshold` is retired: it is skipped for the
rest of the current epoch and left out of all later ones (ScaleRL's No-Positive-Resampling).
"""

from __future__ import annotations

from typing import Any

import numpy as np


class PromptDrawer:
    """Draws batches of prompt indices; its whole state is a plain dict for checkpoints."""

    def __init__(self, num_prompts: int, seed: int):
        self.rng = np.random.default_rng(seed)
        self.retired = np.zeros(num_prompts, dtype=bool)
        self.order = np.zeros(0, dtype=np.int64)
        self.cursor = 0
        self.epoch = 0

    @property
    def num_active(self) -> int:
        return int((~self.retired).sum())

    def draw(self, num: int) -> np.ndarray:
        """`num` distinct active prompts; a new epoch starts when the current one has too few left."""
        if num > self.num_active:
            raise ValueError(f"cannot draw {num} prompts: only {self.num_active} remain in the training set")
        positions = self._remaining_positions()
        if len(positions) < num:
            self._new_epoch()
            positions = self._remaining_positions()
        taken = positions[:num]
        self.cursor = int(taken[-1]) + 1
        return self.order[taken]

    def retire(self, indices: np.ndarray) -> None:
        self.retired[indices] = True

    def _remaining_positions(self) -> np.ndarray:
        """Positions in this epoch's order, from the cursor on, of prompts not retired."""
        return self.cursor + np.flatnonzero(~self.retired[self.order[self.cursor :]])

    def _new_epoch(self) -> None:
        self.order = self.rng.permutation(np.flatnonzero(~self.retired))
        self.cursor = 0
        self.epoch += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": self.rng.bit_generator.state,
            "retired": self.retired.tolist(),
            "order": self.order.tolist(),
            "cursor": self.cursor,
            "epoch": self.epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.retired = np.array(state["retired"], dtype=bool)
        self.order = np.array(state["order"], dtype=np.int64)
        self.cursor = int(state["cursor"])
        self.epoch = int(state["epoch"])
