"""The function every submitted job runs: the hand-off from the launcher to the recipe.

submitit pickles it by reference; the recipe (and with it torch) is imported only inside the
job, never on the login node.
"""


def run_recipe(run_dir: str) -> str:
    """Train the run in `run_dir`; returns its final state."""
    from recipe.job import main

    return main(run_dir)
