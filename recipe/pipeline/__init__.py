"""The pipeline: a run's processes, which task of the job does what, how they meet, and each role's loop.

One run is one Slurm job of `resources.nodes` x `resources.tasks_per_node` tasks (one per GPU on
a GPU node, one process each on CPU), every task running `recipe.job.main`. The layout
(`recipe.config.check_layout`): tasks 0..T-1 train, the last `engine.generator_ranks` generate.

- **Trainer rank 0** (task 0) is the run: it talks to the store, owns the prompt order, the
  admission counter and the drop rule (`recipe.loop.lag`), scores rollouts, trains, evaluates,
  checkpoints, and pushes the weights to the generators after every optimizer step. It runs
  `recipe.loop.train.train` with a `LeadTeam`.
- **Trainer ranks 1..T-1** (`run_trainer_follower`) join the trainers' own torch.distributed
  group (gloo on CPU, NCCL on GPU; WORLD_SIZE/RANK/MASTER_ADDR/MASTER_PORT re-exported for it)
  and take every step with rank 0 on their share of the batch, which rank 0 broadcasts to them.
- **Generators** (`run_generator`) never join that group. Each runs one streaming engine
  (torch or vLLM), takes prompt groups from rank 0 over the control channel
  (`recipe.pipeline.transport`, ZeroMQ), streams finished groups back, and joins every weight push over
  the weight group (`recipe.engines.weights`, trainer rank 0 + generators).

How they meet: task 0 binds the control socket, picks the ports of the trainers' group and of
the weight group, and writes them to RUN_DIR/rendezvous.json under the attempt's key (Slurm job
id and restart count), which every other task waits for. A requeued job is a new attempt with a
new key, so nobody reads a stale file.

Preemption, requeue, time limits: only trainer rank 0 acts on a stop signal (`recipe.job`): it
checkpoints at the next step boundary and tells the others to stop; the other tasks log the
signal and carry on until then. Generators drop what is in flight; the next attempt resumes from
the checkpoint, pushes its weights, and admits new groups from scratch.
"""
