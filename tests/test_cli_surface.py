"""The CLI's surface: every command has help and is documented in the README; its options are
frozen here, so a change to them is a decision, not an accident."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import cli

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()

SURFACE = {
    "launch": ["--dry-run", "--json", "--cluster", "--retry-failed", "--wait", "--max-parallel", "--root", "--max-runs", "--resume-pruned"],
    "status": ["--json", "--watch", "--compute"],
    "report": [
        "--format",
        "--out",
        "--compute",
        "--method",
        "--r0",
        "--cutoff",
        "--bootstrap",
        "--level",
        "--include-flagged",
        "--fit-until",
        "--predict",
        "--ceiling-axes",
        "--own-ceilings",
        "--backtest",
    ],  # fmt: skip
    "cancel": [],
    "logs": ["--stderr", "--stdout", "--follow", "--task"],
    "import": ["--sweep", "--compute-axis", "--format"],
    "show": ["--json"],
    "prune": ["--simulate", "--dry-run", "--json", "--compute"],
    "rerun": ["--seed"],
    "serve": ["--port", "--host", "--compute", "--predict"],
}


def test_the_command_set_is_frozen():
    assert sorted(cli.commands) == sorted(SURFACE)


@pytest.mark.parametrize("command", sorted(SURFACE))
def test_every_command_has_help_and_is_documented(command):
    result = CliRunner().invoke(cli, [command, "--help"])
    assert result.exit_code == 0 and "Usage: " in result.output
    assert cli.commands[command].help, f"sweep {command} has no help text"
    assert f"sweep {command}" in README, f"sweep {command} is not in README.md"
    options = {
        opt for param in cli.commands[command].params for opt in getattr(param, "opts", []) if opt.startswith("--")
    }
    assert options - {"--help"} == set(SURFACE[command])
