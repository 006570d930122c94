#!/usr/bin/env bash
# verify-image.sh: is this image what pins.yaml says? Run inside the image: as the last build
# layer of docker/Dockerfile, and by stage 02 (lib/stages/image.py) after a build.
#
# Prints one line per check, "PASS <check>: <detail>" or "FAIL <check>: <detail>", then a summary;
# exits 1 naming every failed check. Expected values come from the PIN_* environment the
# Dockerfile sets from its ARGs (which equal pins.yaml).
#
# Symbols and strings are counted with a draining `grep -c` on a file, never `grep -q` after a
# pipe: under pipefail grep -q exits at the first match, the writer dies of SIGPIPE (141) and the
# check lies. No check relies on `set -e` either: every failure is counted explicitly.
set -uo pipefail

PYTHON="${PYTHON:-python3}"
WORK="$(mktemp -d)"
trap 'rm -rf "${WORK}"' EXIT
FAILED=()
CHECKS=0

check() { # check NAME OK(0|1) DETAIL
  CHECKS=$((CHECKS + 1))
  if [ "$2" = 1 ]; then
    echo "PASS $1: $3"
  else
    echo "FAIL $1: $3"
    FAILED+=("$1")
  fi
}

count() { # count REGEX FILE: lines of FILE matching REGEX (0 when none or FILE is unreadable)
  local n
  n="$(grep -c -E -- "$1" "$2" 2>/dev/null)" || true
  echo "${n:-0}"
}

is() { # is CONDITION...: 1 when the test holds, else 0
  if test "$@"; then echo 1; else echo 0; fi
}

expect_env() { # expect_env NAME: fail the run early when the Dockerfile did not set it
  if [ -z "${!1:-}" ]; then
    check "environment ${1}" 0 "${1} is unset: run this inside the image built from docker/Dockerfile"
  fi
}

pyval() { # pyval CODE: what a python3 expression prints ("" when it fails)
  "${PYTHON}" -c "$1" 2>/dev/null || true
}

for name in PIN_TORCH_VERSION PIN_VLLM_VERSION PIN_AIPERF_VERSION PIN_NCCL_VERSION \
            PIN_NVSHMEM_VERSION PIN_DEEPEP_SHA PIN_DEEPEP_PATCHED_TREE OFI_NCCL_PLUGIN DEEPEP_HOME \
            AIPERF_HOME; do
  expect_env "${name}"
done
if [ "${#FAILED[@]}" -gt 0 ]; then
  echo "verify-image: ${#FAILED[@]} of ${CHECKS} checks FAILED: ${FAILED[*]}"
  exit 1
fi

# --- the EFA plugin (installer-bundled aws-ofi-nccl) -----------------------------------------
plugin="${OFI_NCCL_PLUGIN}"
check "plugin present" "$(is -s "${plugin}")" "${plugin}"
nm -D --defined-only "${plugin}" > "${WORK}/plugin.syms" 2>/dev/null || true
strings -a "${plugin}" > "${WORK}/plugin.strings" 2>/dev/null || true
n="$(count 'ncclGinPlugin_v14' "${WORK}/plugin.syms")"
check "plugin exports ncclGinPlugin_v14" "$(is "${n}" -ge 1)" "${n} symbol line(s)"
n_strings="$(wc -l < "${WORK}/plugin.strings")"
n="$(count 'GDRCopy support not available at compile time' "${WORK}/plugin.strings")"
check "plugin compiled with GDRCopy" "$(is "${n}" -eq 0 -a "${n_strings}" -gt 0)" \
  "'GDRCopy support not available at compile time' x${n} in ${n_strings} strings"

# --- gdrcopy userspace -------------------------------------------------------------------------
ldconfig -p > "${WORK}/ld.cache" 2>/dev/null || true
n="$(count 'libgdrapi\.so' "${WORK}/ld.cache")"
check "libgdrapi in the loader cache" "$(is "${n}" -ge 1)" "${n} entr(y/ies)"

# --- the winning libnccl.so.2 --------------------------------------------------------------------
nccl_lib="$(pyval 'import os, nvidia.nccl as m; print(os.path.join(list(m.__path__)[0], "lib", "libnccl.so.2"))')"
nccl_real="$(readlink -f "${nccl_lib:-/nonexistent}" 2>/dev/null || true)"
check "pip libnccl.so.2 present" "$(is -n "${nccl_lib}" -a -s "${nccl_real:-/nonexistent}")" \
  "${nccl_lib:-nvidia.nccl not importable}"

# every libnccl.so.2 the loader cache knows is the pip one (no apt libnccl2 shadowing it)
grep -E 'libnccl\.so\.2 ' "${WORK}/ld.cache" > "${WORK}/ld.nccl" 2>/dev/null || true
others=0
while read -r line; do
  path="${line##*=> }"
  if [ "$(readlink -f "${path}")" != "${nccl_real}" ]; then others=$((others + 1)); fi
done < "${WORK}/ld.nccl"
check "no other libnccl.so.2 in the loader cache" "$(is "${others}" -eq 0)" \
  "${others} other(s); cache: $(tr '\n' ';' < "${WORK}/ld.nccl")"

# what the loader resolves for torch and for DeepEP's extension
loads_pip_nccl() { # loads_pip_nccl WHO LIBRARY
  local resolved resolved_real
  ldd "${2:-/nonexistent}" > "${WORK}/ldd" 2>/dev/null || true
  grep -E '^[[:space:]]*libnccl\.so\.2 ' "${WORK}/ldd" > "${WORK}/ldd.nccl" 2>/dev/null || true
  resolved="$(sed -E 's/.*=> ([^ ]+).*/\1/' "${WORK}/ldd.nccl")"
  resolved_real="$(readlink -f "${resolved:-/nonexistent}" 2>/dev/null || true)"
  check "$1 loads the pip libnccl.so.2" "$(is -n "${resolved}" -a "${resolved_real}" = "${nccl_real}")" \
    "${2:-not found} -> ${resolved:-no libnccl.so.2 in ldd}"
}
torch_cuda="$(pyval 'import importlib.util, os; s = importlib.util.find_spec("torch"); print(os.path.join(s.submodule_search_locations[0], "lib", "libtorch_cuda.so"))')"
deepep_so="$(find "${DEEPEP_HOME}/deep_ep" -maxdepth 1 -name '_C*.so' -print -quit 2>/dev/null || true)"
loads_pip_nccl "torch" "${torch_cuda}"
loads_pip_nccl "DeepEP _C" "${deepep_so}"

nm -D --defined-only "${nccl_real:-/nonexistent}" > "${WORK}/nccl.syms" 2>/dev/null || true
for sym in ncclGetLsaDevicePointer ncclDevCommCreate ncclCommWindowRegister ncclTeamWorld; do
  n="$(count "[[:space:]]${sym}\$" "${WORK}/nccl.syms")"
  check "libnccl.so.2 exports ${sym}" "$(is "${n}" -ge 1)" "${n} symbol line(s)"
done

# every NCCL / NVSHMEM symbol DeepEP's extension needs is defined by the libraries that win
nvshmem_host="$(pyval 'import glob, os, nvidia.nvshmem as m; print(sorted(glob.glob(os.path.join(list(m.__path__)[0], "lib", "libnvshmem_host.so.*")))[0])')"
nm -D --defined-only "${nvshmem_host:-/nonexistent}" >> "${WORK}/nccl.syms" 2>/dev/null || true
awk '{ print $NF }' "${WORK}/nccl.syms" | sed 's/@.*//' | sort -u > "${WORK}/defined"
nm -D --undefined-only "${deepep_so:-/nonexistent}" 2>/dev/null | awk '{ print $NF }' | sed 's/@.*//' \
  | grep -E '^(nccl|nvshmem)' | sort -u > "${WORK}/needed" || true
n_needed="$(wc -l < "${WORK}/needed")"
comm -23 "${WORK}/needed" "${WORK}/defined" > "${WORK}/unresolved"
n_unresolved="$(wc -l < "${WORK}/unresolved")"
check "DeepEP _C's NCCL/NVSHMEM symbols all defined" "$(is "${n_needed}" -ge 1 -a "${n_unresolved}" -eq 0)" \
  "${n_needed} needed, ${n_unresolved} unresolved: $(tr '\n' ' ' < "${WORK}/unresolved")"

# --- versions ------------------------------------------------------------------------------------
dist() { pyval "from importlib.metadata import version; print(version('$1'))"; }
v="$(dist nvidia-nccl-cu13)"
check "nvidia-nccl-cu13 == ${PIN_NCCL_VERSION}" "$(is "${v}" = "${PIN_NCCL_VERSION}")" "installed ${v:-none}"
v="$(dist nvidia-nvshmem-cu13)"
check "nvidia-nvshmem-cu13 == ${PIN_NVSHMEM_VERSION}" "$(is "${v}" = "${PIN_NVSHMEM_VERSION}")" "installed ${v:-none}"
v="$(pyval 'import torch; print(torch.__version__)')"  # the dist metadata may drop "+cu130"
check "torch == ${PIN_TORCH_VERSION} (+cu130)" \
  "$(is "${v}" = "${PIN_TORCH_VERSION}" -a "${v%+cu130}" != "${v}")" "installed ${v:-none}"
v="$(dist vllm)"
check "vllm == ${PIN_VLLM_VERSION}" "$(is "${v}" = "${PIN_VLLM_VERSION}")" "installed ${v:-none}"
v="$(pyval "from importlib.metadata import distribution; print(distribution('aiperf', path=['${AIPERF_HOME}']).version)" )"
v="${v:-$(pyval "import importlib.metadata as m; print(next(iter(d.version for d in m.distributions(path=['${AIPERF_HOME}']) if d.metadata['Name'] == 'aiperf'), ''))")}"
check "aiperf == ${PIN_AIPERF_VERSION} in ${AIPERF_HOME}" "$(is "${v}" = "${PIN_AIPERF_VERSION}")" "installed ${v:-none}"

# --- DeepEP: staged at its pin, the trio applied (tree), the overlay applied, built once ------
head_tree="$(git -C "${DEEPEP_HOME}" rev-parse 'HEAD^{tree}' 2>/dev/null || true)"
check "DeepEP tree = ${PIN_DEEPEP_SHA:0:12} + PR #612 trio" "$(is "${head_tree}" = "${PIN_DEEPEP_PATCHED_TREE}")" \
  "HEAD^{tree} ${head_tree:-none}, expected ${PIN_DEEPEP_PATCHED_TREE}"
if git -C "${DEEPEP_HOME}" merge-base --is-ancestor "${PIN_DEEPEP_SHA}" HEAD 2>/dev/null; then ok=1; else ok=0; fi
check "DeepEP HEAD descends from ${PIN_DEEPEP_SHA:0:12}" "${ok}" "$(git -C "${DEEPEP_HOME}" log -1 --format='%h %s' 2>/dev/null || true)"
for file in deep_ep/buffers/elastic.py csrc/elastic/buffer.hpp; do
  check "DeepEP file ${file}" "$(is -s "${DEEPEP_HOME}/${file}")" "${DEEPEP_HOME}/${file}"
done
n="$(count 'EP_EFA_MAX_QPS' "${DEEPEP_HOME}/deep_ep/buffers/elastic.py")"
check "DeepEP EFA auto-QP cap (trio 1/3)" "$(is "${n}" -ge 1)" "EP_EFA_MAX_QPS x${n} in deep_ep/buffers/elastic.py"
n="$(count 'EP_NUM_COMMS' "${DEEPEP_HOME}/deep_ep/buffers/elastic.py")"
check "DeepEP multicomm overlay" "$(is "${n}" -ge 1)" "EP_NUM_COMMS x${n} in deep_ep/buffers/elastic.py"
check "DeepEP _C built" "$(is -n "${deepep_so}" -a -s "${deepep_so:-/nonexistent}")" "${deepep_so:-no deep_ep/_C*.so}"
where="$(pyval 'import importlib.util; s = importlib.util.find_spec("deep_ep"); print(s.submodule_search_locations[0])')"
check "deep_ep found on sys.path" "$(is "${where}" = "${DEEPEP_HOME}/deep_ep")" "${where:-not found}"

# --- vLLM carries the DeepEP V2 backend ---------------------------------------------------------
vllm_dir="$(pyval 'import importlib.util; print(importlib.util.find_spec("vllm").submodule_search_locations[0])')"
n="$(count '^class DeepEPV2All2AllManager' "${vllm_dir:-/nonexistent}/distributed/device_communicators/all2all.py")"
check "vLLM has DeepEPV2All2AllManager" "$(is "${n}" -ge 1)" "x${n} in distributed/device_communicators/all2all.py"
grep -rlE '^class DeepEPV2PrepareAndFinalize' "${vllm_dir:-/nonexistent}" > "${WORK}/pf" 2>/dev/null || true
n="$(wc -l < "${WORK}/pf")"
check "vLLM has DeepEPV2PrepareAndFinalize" "$(is "${n}" -ge 1)" "${n} file(s)"
check "no API shim" "$(is ! -e /opt/api-shim)" "/opt/api-shim absent"

# --- summary -------------------------------------------------------------------------------------
if [ "${#FAILED[@]}" -gt 0 ]; then
  echo "verify-image: ${#FAILED[@]} of ${CHECKS} checks FAILED: ${FAILED[*]}"
  exit 1
fi
echo "verify-image: ${CHECKS}/${CHECKS} checks PASS"
