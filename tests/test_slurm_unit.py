"""Slurm glue that needs no cluster: sacct parsing, state mapping, the generated sbatch script."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from click.testing import CliRunner

from launcher.cli import cli
from launcher.slurm import STATE_MAP, _describe, _parse_sacct, _parse_squeue

GOLDEN = Path(__file__).parent / "golden" / "sbatch_array.sh"

SACCT = """\
12_0|CANCELLED by 0|0:0|vm|2026-12-02T13:20:00|2026-12-02T13:21:00|None
12_1|FAILED|0:9|vm|2026-12-02T13:20:00|Unknown|None
12_[2-4]|PENDING|0:0|None assigned|Unknown|Unknown|JobArrayTaskLimit
13|TIMEOUT|0:15|vm|2026-12-02T13:20:00|2026-12-02T14:20:00|None
14|OUT_OF_MEMORY|0:125|vm|2026-12-02T13:20:00|2026-12-02T14:20:00|None
"""


def test_sacct_rows_become_job_infos():
    infos = _parse_sacct(SACCT)
    assert sorted(infos) == ["12_0", "12_1", "12_2", "12_3", "12_4", "13", "14"]
    assert infos["12_0"].state == "CANCELLED"  # "by 0" dropped
    assert infos["12_3"].node is None and infos["12_3"].reason == "JobArrayTaskLimit"  # from "12_[2-4]"
    assert infos["12_1"].end is None and infos["12_0"].end is not None


def test_collapsed_pending_array_rows_expand_to_their_tasks():
    infos = _parse_sacct("30_[0-2,5%4]|PENDING|0:0|None assigned|Unknown|Unknown|Priority\n")
    assert sorted(infos) == ["30_0", "30_1", "30_2", "30_5"]


def test_failure_descriptions_name_the_signal():
    infos = _parse_sacct(SACCT)
    assert _describe(infos["12_1"]) == "FAILED, killed by signal 9 (SIGKILL)"
    assert _describe(infos["13"]) == "TIMEOUT, killed by signal 15 (SIGTERM)"
    assert STATE_MAP[infos["14"].state] == "failed"


def test_squeue_fallback_parsing():
    infos = _parse_squeue("20_1|RUNNING|vm|None\n20_2|PENDING||Priority\n")
    assert infos["20_1"].state == "RUNNING" and infos["20_1"].node == "vm"
    assert infos["20_2"].node is None and infos["20_2"].reason == "Priority"


def test_dry_run_prints_the_sbatch_script_matching_the_golden_file(tmp_path, monkeypatch):
    """The script `sweep launch --dry-run` shows is the one submitit submits for an array.
    To refresh after an intended change: SWEEP_UPDATE_GOLDEN=1 python -m pytest tests/test_slurm_unit.py"""
    profile = tmp_path / "profile.yaml"
    profile.write_text(
        "partition: gpu\naccount: rl\nqos: high\ngpus_per_node: 8\ntimeout_min: 240\nsetup: ['module load cuda/12.4']\n"
    )
    grid = tmp_path / "g.yaml"
    grid.write_text(
        "name: golden\nrecipe:\n  engine: {generator: torch}\n"  # (vLLM, auto's choice on a GPU node, needs generator ranks)
        f"grid:\n  loss.type: [cispo, grpo, dapo]\nresources: {{profile: {profile}, array_parallelism: 2}}\n"
    )
    monkeypatch.setenv("SWEEP_ROOT", "/ROOT")
    result = CliRunner().invoke(cli, ["launch", str(grid), "--dry-run", "--cluster", "slurm"], terminal_width=200)
    assert result.exit_code == 0, result.output
    script = result.output[result.output.index("#!/bin/bash") :].replace(sys.executable, "PYTHON")
    if os.environ.get("SWEEP_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(script)
    assert script == GOLDEN.read_text(), "sbatch script changed; see the docstring to refresh the golden file"
