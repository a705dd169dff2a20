#!/usr/bin/env bash
# Captures the environment real Slurm tasks see, from a cluster of scripts/lab/slurm.sh, as the
# test vectors of tests/slurm (one file per task: <case>/task<SLURM_PROCID>.env, sorted KEY=VALUE,
# only SLURM_* / CUDA_VISIBLE_DEVICES / GPU_DEVICE_ORDINAL / MASTER_*; lines naming the cluster's
# temp dir are dropped). Re-run (as root) to refresh:  tests/slurm/data/capture.sh
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../../.." && pwd)

if [ "${1:-}" != "--inside" ]; then
  exec "$root/scripts/lab/slurm.sh" run 3 --gpus 2 -- "$0" --inside
fi

out=$here
work=$(mktemp -d /tmp/ctorch-capture.XXXXXX)
trap 'rm -rf "$work"' EXIT
cd "$work"
dump='d="$CAPTURE/$CASE"; mkdir -p "$d";
  env | grep -E "^(SLURM_|SLURMD_NODENAME=|CUDA_VISIBLE_DEVICES=|GPU_DEVICE_ORDINAL=|MASTER_)" |
  grep -v "ctorch-slurm\.\|ctorch-capture\." | sort > "$d/${NAME:-task$SLURM_PROCID}.env"'
export CAPTURE=$out

capture() {  # CASE COMMAND...
  local case=$1; shift
  rm -rf "${out:?}/$case"
  CASE=$case "$@"
  echo "captured $case: $(ls "$out/$case" | tr '\n' ' ')"
}

capture two_nodes srun -N2 bash -c "$dump"
capture single_node srun -N1 bash -c "$dump"
capture subset_step salloc -N3 srun -N2 -w n2,n3 bash -c "$dump"
capture two_per_node srun -N2 --ntasks-per-node=2 bash -c "$dump"
capture uneven_tasks srun -N2 -n3 bash -c "$dump"
capture gpus srun -N2 --gpus-per-node=2 bash -c "$dump"
capture master_port env MASTER_PORT=29555 srun -N2 bash -c "$dump"

# A batch job: the batch script itself (not a step) and one srun step inside it.
cat >job.sh <<JOB
#!/bin/bash
#SBATCH -N 2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
CASE=batch_script NAME=batch bash -c '$dump'
CASE=batch_step srun bash -c '$dump'
JOB
rm -rf "$out/batch_script" "$out/batch_step"
sbatch --wait -o batch.out job.sh >/dev/null
cat batch.out
echo "captured batch_script: $(ls "$out/batch_script" | tr '\n' ' ')"
echo "captured batch_step: $(ls "$out/batch_step" | tr '\n' ' ')"
