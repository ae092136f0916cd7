"""What every submitted job calls: the hand-off from the launcher to the recipe.

submitit pickles it by reference; the recipe (and with it torch) is imported only inside the
job, never on the login node. Once training runs, the recipe handles Slurm's signals itself
(recipe.job). A signal that arrives before that, while the job is still starting, reaches
submitit's handler, which asks `checkpoint` here: the answer is "run me again", and the next
start resumes from the run's newest checkpoint like any other.
"""

from __future__ import annotations

import submitit


class RunRecipe(submitit.helpers.Checkpointable):
    def __call__(self, run_dir: str) -> str:
        """Train the run in `run_dir`; returns the attempt's final state."""
        from recipe.job import main

        return main(run_dir)


run_recipe = RunRecipe()
