#!/bin/bash

# Parameters
#SBATCH --account=rl
#SBATCH --array=0-2%2
#SBATCH --cpus-per-task=1
#SBATCH --error=/ROOT/golden/slurm/%A_%a_0_log.err
#SBATCH --gpus-per-node=8
#SBATCH --job-name=golden
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=/ROOT/golden/slurm/%A_%a_0_log.out
#SBATCH --partition=gpu
#SBATCH --qos=high
#SBATCH --requeue
#SBATCH --signal=USR2@120
#SBATCH --time=240
#SBATCH --wckey=submitit

# setup
module load cuda/12.4

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /ROOT/golden/slurm/%A_%a_%t_log.out --error /ROOT/golden/slurm/%A_%a_%t_log.err PYTHON -u -m submitit.core._submit /ROOT/golden/slurm

