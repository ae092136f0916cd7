"""Runs across machines, on a multi-node Slurm cluster of the tests' own (slurm/dev-cluster.sh with
DEV_CLUSTER_NODES=3 and DEV_CLUSTER_HOME): three slurmd, each in its own network namespace with its
own address and hostname, beside the default one-node cluster, which these tests never touch.
Jobs reach PostgreSQL at the cluster's head address, as on a real cluster."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import sweep_cli as sweep
from conftest import wait_ended, wait_for

from recipe.config import RecipeConfig
from store import Store

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.multinode]
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "slurm" / "dev-cluster.sh"

# The tests' cluster: its own name, files, controller port and node addresses (10.217.0.201-203 on
# the dev clusters' bridge), so that it never meets the default cluster or a user's.
CLUSTER_ENV = {
    "DEV_CLUSTER_NAME": "devtest",
    "DEV_CLUSTER_HOME": "/var/lib/scalesweep-devtest",
    "DEV_CLUSTER_NODES": "3",
    "DEV_CLUSTER_NODE_PREFIX": "tnode",
    "DEV_CLUSTER_NODE_BASE": "200",
    "DEV_CLUSTER_CTLD_PORT": "6837",
    "DEV_CLUSTER_SLURMD_TIMEOUT": "10",
    "DEV_CLUSTER_CPUS": "8",
}
NODES = ["tnode1", "tnode2", "tnode3"]

GRID = """\
name: {name}
recipe:
  batch: {{prompts: 4, generations: 4}}
  optim: {{lr: 3.0e-4, warmup_steps: 0}}
  eval: {{every: {every}, samples: 2}}
  data: {{num_valid_prompts: 32}}
  checkpoint: {{every: {every}}}
  engine: {{generator_ranks: 1, peer_timeout_s: {peer_timeout}}}
resources: {{nodes: 2, tasks_per_node: 2}}
budget: {{steps: {steps}}}
"""


def grid(name: str, steps: int, every: int = 10, peer_timeout: int = 120) -> str:
    return GRID.format(name=name, steps=steps, every=every, peer_timeout=peer_timeout)


def cluster(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args], env={**os.environ, **CLUSTER_ENV}, capture_output=True, text=True, timeout=180
    )
    if check and proc.returncode != 0:
        pytest.fail(f"slurm/dev-cluster.sh {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def multinode() -> dict[str, str]:
    """The tests' 3-node cluster, up for this module and taken down after it."""
    if os.geteuid() != 0:
        from conftest import _unavailable

        _unavailable("a multi-node dev cluster", "creating network namespaces needs root")
    cluster("up")
    head = cluster("address").stdout.strip()
    yield {"SLURM_CONF": f"{CLUSTER_ENV['DEV_CLUSTER_HOME']}/etc/slurm.conf", "head": head}
    cluster("down", check=False)


@pytest.fixture
def on_cluster(multinode, monkeypatch) -> dict[str, str]:
    """Slurm commands of this test (and the launcher's) talk to the tests' cluster; every node is up."""
    monkeypatch.setenv("SLURM_CONF", multinode["SLURM_CONF"])
    for line in slurm("sinfo", "-h", "-N", "-o", "%N %t").splitlines():  # a test before may have killed one
        node, state = line.split()
        if state.rstrip("*") not in ("idle", "mix", "alloc") or state.endswith("*"):
            cluster("heal", node)
            cluster("revive-node", node)
    yield multinode
    # Only this test's jobs: the cluster is the tests' own, and its jobs are theirs.
    for job in slurm("squeue", "-h", "-o", "%i").split():
        subprocess.run(["scancel", job], check=False, capture_output=True)


@pytest.fixture
def head_pg_url(pg_url: str, multinode) -> str:
    """The test's PostgreSQL database at the cluster's head address, where jobs on nodes reach it."""
    return pg_url.replace("127.0.0.1", multinode["head"])


def slurm(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=30).stdout




def show(db: str, run_id: str) -> dict:
    code, out = sweep(db, "show", run_id, "--json")
    assert code == 0, out
    return json.loads(out)


def assert_clean_curve(store: Store, run_id: str) -> None:
    from recipe.loop.evaluate import is_eval_step

    cfg = RecipeConfig.from_dict(store.get_run(run_id).config)
    steps = [s for s in range(cfg.budget.steps + 1) if is_eval_step(s, cfg)]
    expected = steps if steps[-1] == cfg.budget.steps else [*steps, cfg.budget.steps]
    assert [p.step for p in store.eval_points(run_id)] == expected


def launch(db: str, sweep_file, text: str) -> str:
    path = sweep_file(text)
    code, out = sweep(db, "launch", str(path), "--cluster", "slurm")
    assert code == 0, out
    (run,) = Store(db).runs(text.split("\n", 1)[0].removeprefix("name: "))
    return run.id


def task_hosts(db: str, run_id: str) -> dict[str, str]:
    """Every task's host in the newest attempt, by role and rank ("trainer 0", "generator 0")."""
    return {f"{t['role']} {t['rank']}": t["host"] for t in show(db, run_id)["hosts"]}


# ---------------------------------------------------------------------------------------------


def test_three_nodes_have_their_own_names_and_addresses(on_cluster):
    rows = [line.split() for line in slurm("sinfo", "-h", "-N", "-o", "%N %o").splitlines()]
    assert sorted(name for name, _ in rows) == NODES
    assert len({addr for _, addr in rows}) == 3 and all(addr.startswith("10.217.") for _, addr in rows)
    names = slurm("srun", "-N3", "hostname").split()
    assert sorted(names) == NODES


def test_a_run_spans_two_nodes_with_its_generator_off_the_first(on_cluster, sweep_file, head_pg_url):
    run_id = launch(head_pg_url, sweep_file, grid("span", 20))
    (row,) = wait_ended(head_pg_url, "span")
    assert row["state"] == "completed", (row["state"], row["reason"])
    store = Store(head_pg_url)
    assert_clean_curve(store, run_id)
    hosts = task_hosts(head_pg_url, run_id)
    assert set(hosts) == {"trainer 0", "trainer 1", "trainer 2", "generator 0"}, hosts
    assert len(set(hosts.values())) == 2
    assert hosts["trainer 0"] == hosts["trainer 1"] != hosts["generator 0"] == hosts["trainer 2"]
    # Every task's log is reachable from the login node.
    code, out = sweep(head_pg_url, "logs", run_id, "--task", "3", "--stdout")
    assert code == 0 and "generator" in out, out


def newest_attempt_running_past(store: Store, run_id: str, step: int):
    run, attempts = store.get_run(run_id), store.attempts(run_id)
    assert run.state not in ("failed", "cancelled", "completed"), f"run {run_id} ended early: {run.state_reason}"
    if run.state == "running" and run.step > step and attempts and attempts[-1].state == "running":
        return attempts[-1]
    return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_dead_node_requeues_the_job_and_the_run_resumes_with_a_clean_curve(on_cluster, sweep_file, head_pg_url):
    # Slurm notices the dead node (SlurmdTimeout, 10 s here) long before trainer rank 0 would give up on its peers.
    run_id = launch(head_pg_url, sweep_file, grid("nodefail", 1200, every=50, peer_timeout=300))
    store = Store(head_pg_url)
    wait_for(lambda: newest_attempt_running_past(store, run_id, 120), what="the run to pass step 120")
    hosts = task_hosts(head_pg_url, run_id)
    dead = hosts["generator 0"]
    assert dead != hosts["trainer 0"]
    cluster("kill-node", dead)  # slurmd, the job's tasks on it, its link: all gone at once
    (row,) = wait_ended(head_pg_url, "nodefail", timeout_s=600)
    assert row["state"] == "completed", (row["state"], row["reason"])
    first, *_, last = store.attempts(run_id)
    # Closed by `sweep status` from Slurm's NODE_FAIL, or by the next attempt's start if no status ran between.
    assert first.state == "preempted" and ("NODE_FAIL" in first.exit_reason or "without a word" in first.exit_reason)
    assert last.state == "completed" and last.resumed_from_step >= 100
    assert dead not in task_hosts(head_pg_url, run_id).values()  # the new attempt ran on the nodes left
    assert_clean_curve(store, run_id)


def test_a_killed_generator_fails_the_attempt_naming_it_and_its_log(on_cluster, sweep_file, head_pg_url):
    run_id = launch(head_pg_url, sweep_file, grid("genkill", 20000, peer_timeout=60))
    store = Store(head_pg_url)
    wait_for(lambda: newest_attempt_running_past(store, run_id, 40), what="the run to pass step 40")
    (generator,) = [t for t in show(head_pg_url, run_id)["hosts"] if t["role"] == "generator"]
    os.kill(generator["pid"], 9)
    killed_at = time.monotonic()
    (row,) = wait_ended(head_pg_url, "genkill", timeout_s=120)
    assert row["state"] == "failed", row
    assert time.monotonic() - killed_at < 90  # trainer rank 0 did not wait for ever
    reason = row["reason"]
    assert f"generator 0 (task {generator['task']} on {generator['host']})" in reason, reason
    assert f"sweep logs {run_id} --task {generator['task']}" in reason, reason
    # The job ends too: trainer rank 0 stops the other tasks on its way out, none is left behind.
    wait_for(lambda: not slurm("squeue", "-h", "-o", "%i").split(), 60, "the job to leave the queue")


def test_a_partition_longer_than_the_peer_timeout_ends_the_attempt_and_never_hangs(on_cluster, sweep_file, head_pg_url):
    run_id = launch(head_pg_url, sweep_file, grid("partition", 3000, every=50, peer_timeout=60))
    store = Store(head_pg_url)
    wait_for(lambda: newest_attempt_running_past(store, run_id, 60), what="the run to pass step 60")
    cut = task_hosts(head_pg_url, run_id)["generator 0"]
    cluster("partition", cut)
    try:
        first = wait_for(
            lambda: next((a for a in store.attempts(run_id) if a.number == 1 and a.state != "running"), None),
            timeout_s=120, what="the partitioned attempt to end",
        )  # fmt: skip
    finally:
        cluster("heal", cut)
    # Trainer rank 0 named whom it lost, or Slurm took the node for dead first and requeued the job.
    assert "generator 0" in (first.exit_reason or "") or first.state == "preempted", first
    code, out = sweep(head_pg_url, "cancel", run_id)  # what comes next (a requeued attempt) is the other tests'
    assert code == 0, out
    wait_for(lambda: not slurm("squeue", "-h", "-o", "%i").split(), 120, "the job to leave the queue")


def test_scontrol_requeue_of_a_two_node_job_checkpoints_once_and_resumes_once(on_cluster, sweep_file, head_pg_url):
    text = grid("requeue", 1000, every=1000)  # no periodic checkpoint before the requeue
    run_id = launch(head_pg_url, sweep_file, text)
    store = Store(head_pg_url)
    attempt = wait_for(lambda: newest_attempt_running_past(store, run_id, 150), what="the run to pass step 150")
    pids = [t["pid"] for t in show(head_pg_url, run_id)["hosts"]]
    assert len({t["host"] for t in show(head_pg_url, run_id)["hosts"]}) == 2
    subprocess.run(["scontrol", "requeue", attempt.job_id], check=True)
    wait_for(lambda: len(store.attempts(run_id)) == 2 and store.attempts(run_id)[1].state == "running", what="attempt 2")
    assert not any(alive(pid) for pid in pids)  # both nodes' tasks of attempt 1 stopped before attempt 2 ran
    (row,) = wait_ended(head_pg_url, "requeue", timeout_s=600)
    assert row["state"] == "completed", (row["state"], row["reason"])
    first, second = store.attempts(run_id)
    assert first.state == "preempted" and "checkpoint written" in first.exit_reason, first
    resumed = second.resumed_from_step
    assert resumed and resumed >= 150
    assert [c.step for c in store.checkpoints(run_id) if c.step % 1000] == [resumed]  # the one checkpoint of the requeue
    assert_clean_curve(store, run_id)
