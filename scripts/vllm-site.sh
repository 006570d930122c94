#!/usr/bin/env bash
# Unpack the vLLM site folder on a GPU machine without network, from the parts it travelled in.
#   scripts/vllm-site.sh PARTS_DIR DEST   (DEST/vllm-site goes into gpu-run.sh's SITES)
# PARTS_DIR holds part.0, part.1, ... and sum.txt: the sha256 of the joined vllm-site.tar.xz.
# The archive was made on a machine with PyPI from exactly the wheels of requirements-gpu.txt
# (vLLM's part; not the NCCL/NVSHMEM wheels), see book/gpu_install.md:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform ... -r REQS -d W
#   pip install --no-index --no-deps --no-compile --target vllm-site --python-version 3.12 ... W/*.whl
#   tar -cf - --exclude=vllm-site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so \
#     --exclude=vllm-site/vllm/vllm-rs --exclude=vllm-site/bin vllm-site | xz -6 -T2 > vllm-site.tar.xz
#   split -n 3 -d -a 1 vllm-site.tar.xz part.   (3 parts of ~50 MiB)
# Left out to fit the 64 MiB a call may carry: FlashAttention-2's kernels (Hopper runs FA3:
# vLLM 0.24.0 picks FA3 on compute capability 9 and imports FA2 optionally), the Rust front-end
# binary (used only with VLLM_RUST_FRONTEND_PATH), console scripts (`python3 -m` runs vLLM).
# Any folder packed the same way unpacks the same way (the NCCL/NVSHMEM site DeepEP is built
# against, a DeepEP checkout with its fmt submodule): the script extracts what the archive holds.
set -euo pipefail
parts=${1:?folder of part.N files and sum.txt}
dest=${2:?destination folder}
want=$(awk '{print $1}' "$parts/sum.txt")
mkdir -p "$dest"
mapfile -t pieces < <(find "$parts" -maxdepth 1 -name 'part.*' | sort -t. -k2 -n)
cat "${pieces[@]}" > "$dest/vllm-site.tar.xz"
got=$(sha256sum "$dest/vllm-site.tar.xz" | awk '{print $1}')
if [[ "$got" != "$want" ]]; then
  echo "vllm-site.sh: sha256 $got of the joined parts != $want in sum.txt" >&2
  exit 1
fi
# the listing goes to a file, never through `| head` (SIGPIPE would fail tar under pipefail)
tar -xvJf "$dest/vllm-site.tar.xz" -C "$dest" > "$dest/.unpacked.txt"
top=$(head -n 1 "$dest/.unpacked.txt" | cut -d/ -f1)
rm -f "$dest/vllm-site.tar.xz" "$dest/.unpacked.txt"
# A vLLM site gets this project's pinned vLLM patches (pins.yaml, kind patch, applies_to vllm),
# recorded in the site (lib/site_patches.py) and, from there, in each run's run.json.
if compgen -G "$dest/$top/vllm-*.dist-info" > /dev/null; then
  # PIN_SET names the pin set the site is (pins.yaml `sets:`; unset: the base set)
  (cd "$(dirname "$0")/.." && python3 -m lib.engines.site_patches apply "$dest/$top" vllm \
      ${PIN_SET:+--pin-set "$PIN_SET"})
fi
echo "vllm-site.sh: $dest/$top ready (sha256 $want)"
