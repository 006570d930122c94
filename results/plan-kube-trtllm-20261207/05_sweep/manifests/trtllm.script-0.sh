#!/usr/bin/env bash
set -euo pipefail
host="${HOSTNAME:-}"
ordinal="${host##*-}"
if [[ ! "${ordinal}" =~ ^[0-9]+$ || "${host}" != "trtllm-${ordinal}" ]]; then
  echo "guide-entrypoint: HOSTNAME='${host}' is not trtllm-<ordinal>: the ordinal comes from a StatefulSet pod's hostname" >&2
  exit 64
fi
unset NVSHMEM_IB_ENABLE_IBGDA
case "${ordinal}" in
  0)
    echo "guide-entrypoint: ordinal 0, the leader"
    exec mpirun \
      --allow-run-as-root -np \
      16 -H \
      trtllm-0.trtllm.deepep-repro.svc:8,trtllm-1.trtllm.deepep-repro.svc:8 \
      --mca plm_rsh_agent \
      'ssh -p 2222 -o BatchMode=yes -o StrictHostKeyChecking=no' -x \
      DEEPEP_V2_CPU_TIMEOUT_S -x \
      DEEPEP_V2_GPU_TIMEOUT_S -x \
      EP_EFA_MAX_QPS -x \
      EP_EFA_RDMA_GBS -x \
      EP_REUSE_NCCL_COMM -x \
      FI_EFA_ENABLE_SHM_TRANSFER -x \
      FI_EFA_USE_DEVICE_RDMA -x \
      FI_PROVIDER -x \
      NCCL_CUMEM_ENABLE -x \
      NCCL_DEBUG -x \
      NCCL_DEBUG_SUBSYS -x \
      NCCL_GIN_ENABLE -x \
      NCCL_GIN_TYPE -x \
      NCCL_IGNORE_DISABLED_P2P -x \
      NCCL_NET_PLUGIN -x \
      NCCL_NVLS_ENABLE -x \
      NCCL_SOCKET_IFNAME -x \
      OFI_NCCL_PROTOCOL -x \
      OMPI_ALLOW_RUN_AS_ROOT -x \
      OMPI_ALLOW_RUN_AS_ROOT_CONFIRM -x \
      TRTLLM_CAN_USE_DEEP_EP -x \
      TRTLLM_MOE_DISABLE_ALLTOALLV trtllm-llmapi-launch \
      trtllm-serve serve \
      Qwen/Qwen3-30B-A3B-FP8 \
      --tp_size 16 \
      --ep_size 16 \
      --host 0.0.0.0 \
      --port 8000 \
      --backend pytorch \
      --max_batch_size 16 \
      --max_num_tokens 8192 \
      --kv_cache_free_gpu_memory_fraction 0.7 \
      --trust_remote_code
    ;;
  1)
    echo "guide-entrypoint: ordinal 1, the worker"
    exec /usr/sbin/sshd -D -e -p 2222
    ;;
  *)
    echo "guide-entrypoint: ordinal ${ordinal} is not one this pod serves (0, 1)" >&2
    exit 64
    ;;
esac
