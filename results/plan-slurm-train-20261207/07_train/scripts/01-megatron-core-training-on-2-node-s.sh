#!/bin/bash
# shellcheck disable=SC2016  # every argv element is literal: a '$' in one is data
# megatron-core training: one task per node; node N runs its own argv and env (SLURM_NODEID = N)
set -u
node="${SLURM_NODEID:?not a Slurm task: SLURM_NODEID is unset}"
rc_file='{run}/07_train/megatron-core-training-<job-1>-node'"$node".rc
trap 'echo "node $node: SIGTERM (the step is being ended)" >&2' TERM
case "$node" in
  0)
    export MASTER_ADDR=node-0 OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore::UserWarning,ignore::FutureWarning
    cmd=(python3 -m torch.distributed.run --nproc-per-node=8 --nnodes=2 --node-rank=0 --master-addr=node-0 --master-port=29500 -m lib.bench.moe_train --steps 5 --layers 2 --hidden 2048 --ffn-hidden 1024 --heads 16 --experts 128 --topk 8 --vocab 4096 --seq-len 1024 --micro-batch 8 --lr 0.0003 --dispatcher alltoall --seed 0 --backend nccl)
    ;;
  1)
    export MASTER_ADDR=node-0 OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore::UserWarning,ignore::FutureWarning
    cmd=(python3 -m torch.distributed.run --nproc-per-node=8 --nnodes=2 --node-rank=1 --master-addr=node-0 --master-port=29500 -m lib.bench.moe_train --steps 5 --layers 2 --hidden 2048 --ffn-hidden 1024 --heads 16 --experts 128 --topk 8 --vocab 4096 --seq-len 1024 --micro-batch 8 --lr 0.0003 --dispatcher alltoall --seed 0 --backend nccl)
    ;;
  *)
    echo "node $node: this step has no command for it" >&2
    exit 64
    ;;
esac
"${cmd[@]}"
rc=$?
printf '%s\n' "$rc" > "$rc_file"
exit "$rc"
