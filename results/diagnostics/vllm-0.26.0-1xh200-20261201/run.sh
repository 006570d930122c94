#!/usr/bin/env bash
# The device side of this diagnostic, on one lent H200 (no network), from the repository root there.
#   run.sh carry N PARTS   copy part.N (and sum.txt, if there) from PARTS into /tmp/v026parts; on
#                          the first carry also record the machine and start building the seeded
#                          model in its own session (it outlives the call, on the warm machine)
#   run.sh record PARTS    the last part, then: join and check the parts, unpack the vLLM 0.26.0
#                          site, record versions, wait for the model, record.py, one tar in $OUT
# The parts were made on a machine with PyPI (README.md here says how): vllm-site.tar.xz of the
# wheels of requirements-gpu-current.txt above its NCCL line, split in 3, sha256 in sum.txt.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=/tmp/v026-out          # everything that comes back, tarred at the end
parts_dir=/tmp/v026parts
site=/tmp/v026site
mkdir -p "$work" "$parts_dir" "$site"

carry() {
  local n=$1 from=$2
  cp "$from/part.$n" "$parts_dir/" && { [[ ! -f "$from/sum.txt" ]] || cp "$from/sum.txt" "$parts_dir/"; }
  ls -l "$parts_dir" | tee -a "$work/carry.log"
}

case "${1:-}" in
  carry)
    carry "$2" "$3"
    if [[ "$2" == 0 ]]; then
      {
        date -u +%FT%TZ; nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.total --format=csv
        ldd --version | head -n 1; uname -r; command -v python3; python3 -V
        python3 -m pip list 2>/dev/null | grep -iE '^(torch|transformers|tokenizers|numpy|numba|triton|nvidia-nccl-cu13|nvidia-nvshmem-cu13|safetensors|huggingface.hub|uvloop|aiohttp|psutil|requests|pillow|prometheus.client|sentencepiece|tiktoken|einops|protobuf|pyyaml|regex|cloudpickle|filelock|py-cpuinfo|opencv-python-headless|setuptools|six|ninja|tqdm|typing.extensions|packaging|httpx|anyio) '
      } > "$work/machine.txt" 2>&1
      cat "$work/machine.txt"
      # the model build needs only the machine's torch and transformers (lib.engines.models)
      setsid nohup env PYTHONPATH="$PWD" bash -c \
        'start=$(date +%s); python3 -m lib.models build --seed 0 --flavor vllm; echo "rc=$? took=$(( $(date +%s) - start ))s"' \
        > "$work/model-build.log" 2>&1 < /dev/null &
      echo "model build started in its own session (pid $!)"
    fi
    ;;
  record)
    carry 2 "$2"
    bash "$0" _record 2>&1 | tee "$work/run.log"
    tar -C /tmp -cf "$OUT/vllm-0.26.0-1xh200.tar" v026-out
    ls -l "$OUT"
    ;;
  _record)
    date -u +%FT%TZ
    want=$(awk '{print $1}' "$parts_dir/sum.txt")
    cat "$parts_dir"/part.0 "$parts_dir"/part.1 "$parts_dir"/part.2 > "$site/vllm-site.tar.xz"
    got=$(sha256sum "$site/vllm-site.tar.xz" | awk '{print $1}')
    echo "joined sha256 $got, sum.txt $want"
    [[ "$got" == "$want" ]] || { echo "parts do not join to sum.txt"; exit 1; }
    t0=$SECONDS
    tar -xJf "$site/vllm-site.tar.xz" -C "$site" && rm -f "$site/vllm-site.tar.xz"
    echo "unpacked in $((SECONDS - t0)) s: $(du -sb "$site/vllm-site" | cut -f1) bytes"
    export PYTHONPATH="$site/vllm-site:$PWD"
    t0=$SECONDS
    python3 - > "$work/versions.json" 2> "$work/versions.err" <<'PY'
import json, importlib.metadata as md
import torch, transformers, tokenizers, numpy, triton
import vllm
out = {"vllm": vllm.__version__, "vllm_file": vllm.__file__, "torch": torch.__version__,
       "torch_cuda": torch.version.cuda, "torch_nccl_build": ".".join(map(str, torch.cuda.nccl.version())),
       "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
       "numpy": numpy.__version__, "triton": triton.__version__,
       "gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0))}
for dist in ("nvidia-nccl-cu13", "nvidia-nvshmem-cu13", "numba", "pydantic", "fastapi", "openai",
             "xgrammar", "llguidance", "apache-tvm-ffi"):
    try:
        out[dist] = md.version(dist)
    except md.PackageNotFoundError:
        out[dist] = None
print(json.dumps(out, indent=1))
PY
    rc=$?
    echo "versions (import vllm took $((SECONDS - t0)) s): rc=$rc"; cat "$work/versions.json"; tail -n 5 "$work/versions.err"
    for _ in $(seq 1 90); do grep -q '^rc=' "$work/model-build.log" 2>/dev/null && break; sleep 2; done
    cat "$work/model-build.log"
    left=$(( ${BUDGET_S:-560} - SECONDS ))
    echo "record.py with ${left} s left"
    PYTHONUNBUFFERED=1 timeout "$left" python3 "$here/record.py" "$work"
    echo "record.py rc=$?"
    date -u +%FT%TZ
    running=$(pgrep -f "vllm.entrypoints.cli.main serve" || true)
    [[ -z "$running" ]] || echo "serves still running: $running"
    ;;
  *)
    echo "usage: run.sh carry N PARTS | run.sh record PARTS" >&2; exit 2 ;;
esac
