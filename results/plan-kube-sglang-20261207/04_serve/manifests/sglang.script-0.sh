#!/usr/bin/env bash
set -euo pipefail
host="${HOSTNAME:-}"
ordinal="${host##*-}"
if [[ ! "${ordinal}" =~ ^[0-9]+$ || "${host}" != "sglang-${ordinal}" ]]; then
  echo "guide-entrypoint: HOSTNAME='${host}' is not sglang-<ordinal>: the ordinal comes from a StatefulSet pod's hostname" >&2
  exit 64
fi
unset NVSHMEM_IB_ENABLE_IBGDA
case "${ordinal}" in
  0)
    echo "guide-entrypoint: ordinal 0, the leader"
    exec sglang serve \
      --model-path Qwen/Qwen3-30B-A3B-FP8 \
      --revision d206ba732169f29bb77fbf80fc2c4b81d4d30782 \
      --tp-size 16 \
      --dp-size 16 \
      --enable-dp-attention \
      --ep-size 16 \
      --moe-a2a-backend deepep_v2 \
      --deepep-v2-mode hybrid \
      --moe-runner-backend deep_gemm \
      --chunked-prefill-size 16384 \
      --nnodes 2 \
      --node-rank 0 \
      --dist-init-addr sglang-0.sglang.deepep-repro.svc:29570 \
      --host 0.0.0.0 \
      --port 8000 \
      --enable-metrics \
      --disable-cuda-graph
    ;;
  1)
    echo "guide-entrypoint: ordinal 1, the worker"
    exec sglang serve \
      --model-path Qwen/Qwen3-30B-A3B-FP8 \
      --revision d206ba732169f29bb77fbf80fc2c4b81d4d30782 \
      --tp-size 16 \
      --dp-size 16 \
      --enable-dp-attention \
      --ep-size 16 \
      --moe-a2a-backend deepep_v2 \
      --deepep-v2-mode hybrid \
      --moe-runner-backend deep_gemm \
      --chunked-prefill-size 16384 \
      --nnodes 2 \
      --node-rank 1 \
      --dist-init-addr sglang-0.sglang.deepep-repro.svc:29570 \
      --host 0.0.0.0 \
      --port 8000 \
      --enable-metrics \
      --disable-cuda-graph
    ;;
  *)
    echo "guide-entrypoint: ordinal ${ordinal} is not one this pod serves (0, 1)" >&2
    exit 64
    ;;
esac
