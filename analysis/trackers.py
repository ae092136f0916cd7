"""Where a run's experiment-tracker entry is (the sweep file's `tracking:` block, mirrored by
recipe/telemetry/trackers.py): links for `sweep serve` and `sweep report --format html`.

The conventions are the mirror's: the W&B run id is the scalesweep run id (one W&B run per run,
resumed across attempts), its offline files lie under RUN_DIR/wandb/, TensorBoard's event files
under RUN_DIR/tensorboard/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

WANDB_DIR = "wandb"
TENSORBOARD_DIR = "tensorboard"


def tracker_links(block: dict[str, Any], sweep: str, run_id: str, run_dir: str) -> list[dict[str, str]]:
    """[{"tracker", "label", "href"}] for each tracker the block turns on."""
    links = []
    wandb = block.get("wandb")
    if wandb:
        wandb = wandb if isinstance(wandb, dict) else {}
        project = wandb.get("project") or "scalesweep"
        entity = wandb.get("entity")
        if wandb.get("mode", "online") == "online" and entity:
            href = f"https://wandb.ai/{entity}/{project}/runs/{run_id}"
        else:  # offline (or the user's default entity): the files to `wandb sync`
            href = (Path(run_dir) / WANDB_DIR).as_uri()
        links.append({"tracker": "wandb", "label": f"W&B {project}/{run_id}", "href": href})
    if block.get("tensorboard"):
        links.append(
            {"tracker": "tensorboard", "label": "TensorBoard events", "href": (Path(run_dir) / TENSORBOARD_DIR).as_uri()}
        )
    return links
