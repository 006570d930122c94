#!/usr/bin/env bash
# build_deepep.sh: the one way this guide builds DeepEP's extension (deep_ep/_C*.so), on a GPU
# machine and (once the image's build context admits this file) in the image.
#
# Usage:
#   docker/build_deepep.sh --src DIR --sha SHA40 --site DIR \
#       --nccl-version 2.30.4 --nvshmem-version 3.6.5 --max-jobs N --log FILE \
#       [--arch-list 9.0] [--python python3] [--patched-tree TREE40] [--skip-import REASON]
#
#   --src DIR            a checkout of deepseek-ai/DeepEP at the pinned commit (this repository
#                        never holds DeepEP's source; this script never clones)
#   --sha SHA40          the pinned commit, full 40 hex (pins.yaml); `git -C DIR rev-parse HEAD`
#                        must equal it and the tracked tree must be clean
#   --patched-tree T40   instead: HEAD descends from --sha and HEAD^{tree} equals T40 (the image
#                        applies the PR #612 trio with `git am`); uncommitted changes are listed
#   --site DIR           the site-packages folder holding nvidia-nccl-cu13 and
#                        nvidia-nvshmem-cu13 (pip install [--target DIR]); the NCCL and NVSHMEM
#                        roots are DIR/nvidia/nccl and DIR/nvidia/nvshmem
#   --nccl-version V     the nvidia-nccl-cu13 version DIR must hold (pins.yaml: 2.30.4)
#   --nvshmem-version V  the nvidia-nvshmem-cu13 version DIR must hold (pins.yaml: 3.6.5)
#   --max-jobs N         MAX_JOBS for torch's ninja build
#   --log FILE           the whole build log (created or truncated; never tailed)
#   --arch-list A        TORCH_CUDA_ARCH_LIST (default 9.0: H100/H200)
#   --python P           the python holding torch (default python3)
#   --skip-import REASON do not import the result; REASON is printed (a docker build has no
#                        driver, so `import deep_ep` cannot load libcuda.so.1 there)
#
# What it does, each step fail-loud (exit 1 naming what failed; argument errors exit 2 naming the
# argument):
#   1. the checkout is the pin (above) and its fmt submodule has fmt >= 11 (fmt/base.h);
#   2. the site folder holds the pinned wheels; the unversioned libnccl.so / libnvshmem_host.so
#      links that setup.py at b306af06 links against (`-l:libnccl.so`) are created when absent;
#   3. `python3 setup.py build_ext --inplace` (the measured form) with DeepEP's own root variables
#      set: EP_NCCL_ROOT_DIR and NCCL_DIR, EP_NVSHMEM_ROOT_DIR and NVSHMEM_DIR (deep_ep/utils/
#      find_pkgs.py reads EP_<NAME>_ROOT_DIR first, then <NAME>_DIR, then installed packages),
#      and the NCCL/NVSHMEM lib folders (plus the CUDA stubs, for -lcuda without a driver) on
#      LIBRARY_PATH: setup.py passes -L for NVSHMEM only, not for its -l:libnccl.so*;
#      the whole output goes to --log; on failure its last 40 lines are printed;
#   4. exactly one deep_ep/_C*.so results;
#   5. `import deep_ep; deep_ep.ElasticBuffer` with LD_PRELOAD=<site>/nvidia/nccl/lib/libnccl.so.2
#      (torch otherwise loads its own older NCCL first and DeepEP built for 2.30.4 segfaults, or
#      deep_ep's own check refuses the duplicate NCCL) and PYTHONPATH=<site>:<src>: the site
#      first, or the machine's own NVSHMEM (3.4.5 beside the H200 image's torch) is the one found
#      and deep_ep/_C fails with "undefined symbol: nvshmem_selected_device_transport" (measured
#      2026-11-30; lib.transport.deepep_pythonpath is the same order for test_ep and vLLM).
# Counts use a draining `grep -c` on a file, never `grep -q` after a pipe (SIGPIPE under pipefail).
set -euo pipefail

PROG="build_deepep.sh"
TAIL_LINES=40

usage_error() { # usage_error ARGUMENT MESSAGE
  echo "${PROG}: argument $1: $2" >&2
  echo "${PROG}: usage: ${PROG} --src DIR --sha SHA40 --site DIR --nccl-version V --nvshmem-version V --max-jobs N --log FILE [--arch-list A] [--python P] [--patched-tree TREE40] [--skip-import REASON]" >&2
  exit 2
}

fail() { # fail MESSAGE...: a check failed
  echo "FAIL ${PROG}: $*" >&2
  exit 1
}

log() { # log MESSAGE: to stdout and the build log (once it exists)
  echo "${PROG}: $*"
  if [ -n "${LOG:-}" ] && [ -f "${LOG}" ]; then echo "${PROG}: $*" >> "${LOG}"; fi
}

fail_with_log_tail() { # fail_with_log_tail MESSAGE: the last lines of the log, then exit 1
  echo "FAIL ${PROG}: $1" >&2
  echo "----- last ${TAIL_LINES} lines of ${LOG} (the whole log is that file) -----" >&2
  tail -n "${TAIL_LINES}" "${LOG}" >&2
  echo "----- end of ${LOG} -----" >&2
  exit 1
}

is_full_sha() { [[ "$1" =~ ^[0-9a-f]{40}$ ]]; }

# ---- arguments ----------------------------------------------------------------------------------
SRC="" SHA="" SITE="" NCCL_VERSION="" NVSHMEM_VERSION="" MAX_JOBS_ARG="" LOG=""
ARCH_LIST="9.0" PYTHON="python3" PATCHED_TREE="" SKIP_IMPORT=""
while [ "$#" -gt 0 ]; do
  opt="$1"
  case "${opt}" in
    --src|--sha|--site|--nccl-version|--nvshmem-version|--max-jobs|--log|--arch-list|--python|--patched-tree|--skip-import)
      if [ "$#" -lt 2 ] || [ -z "$2" ]; then usage_error "${opt}" "needs a value"; fi
      value="$2"
      shift 2
      ;;
    *) usage_error "${opt}" "unknown argument" ;;
  esac
  case "${opt}" in
    --src) SRC="${value}" ;;
    --sha) SHA="${value}" ;;
    --site) SITE="${value}" ;;
    --nccl-version) NCCL_VERSION="${value}" ;;
    --nvshmem-version) NVSHMEM_VERSION="${value}" ;;
    --max-jobs) MAX_JOBS_ARG="${value}" ;;
    --log) LOG="${value}" ;;
    --arch-list) ARCH_LIST="${value}" ;;
    --python) PYTHON="${value}" ;;
    --patched-tree) PATCHED_TREE="${value}" ;;
    --skip-import) SKIP_IMPORT="${value}" ;;
  esac
done

for pair in src=SRC sha=SHA site=SITE nccl-version=NCCL_VERSION nvshmem-version=NVSHMEM_VERSION \
            max-jobs=MAX_JOBS_ARG log=LOG; do
  var="${pair#*=}"
  if [ -z "${!var}" ]; then usage_error "--${pair%%=*}" "is required"; fi
done
if ! is_full_sha "${SHA}"; then
  usage_error --sha "'${SHA}' is not a full 40-hex commit SHA (short SHAs are refused: give the full SHA from pins.yaml)"
fi
if [ -n "${PATCHED_TREE}" ] && ! is_full_sha "${PATCHED_TREE}"; then
  usage_error --patched-tree "'${PATCHED_TREE}' is not a full 40-hex tree SHA"
fi
if ! [[ "${MAX_JOBS_ARG}" =~ ^[1-9][0-9]*$ ]]; then
  usage_error --max-jobs "'${MAX_JOBS_ARG}' is not an integer >= 1"
fi
arch_re='^[0-9]+\.[0-9]+[a-z]?(\+PTX)?([; ][0-9]+\.[0-9]+[a-z]?(\+PTX)?)*$'
if ! [[ "${ARCH_LIST}" =~ ${arch_re} ]]; then
  usage_error --arch-list "'${ARCH_LIST}' is not a TORCH_CUDA_ARCH_LIST such as 9.0 or '9.0;10.0'"
fi
if [ ! -d "${SRC}" ]; then usage_error --src "'${SRC}' is not a directory"; fi
if [ ! -d "${SITE}" ]; then usage_error --site "'${SITE}' is not a directory"; fi
SRC="$(cd "${SRC}" && pwd -P)"
SITE="$(cd "${SITE}" && pwd -P)"

# ---- 1. the checkout is the pin -----------------------------------------------------------------
if ! head="$(git -C "${SRC}" rev-parse --verify -q HEAD 2>/dev/null)"; then
  fail "--src ${SRC} is not a git checkout with a commit (DeepEP must be a checkout of the pinned commit ${SHA})"
fi
work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT
git -C "${SRC}" status --porcelain --untracked-files=no > "${work}/dirty"
n_dirty="$(wc -l < "${work}/dirty")"
if [ -z "${PATCHED_TREE}" ]; then
  if [ "${head}" != "${SHA}" ]; then
    fail "DeepEP checkout ${SRC} is at HEAD ${head}, expected --sha ${SHA}: check out the pinned commit (git -C ${SRC} checkout ${SHA})"
  fi
  if [ "${n_dirty}" -gt 0 ]; then
    fail "DeepEP checkout ${SRC} has ${n_dirty} uncommitted change(s) to tracked files, so it is not ${SHA}: $(tr '\n' ';' < "${work}/dirty")"
  fi
  echo "${PROG}: DeepEP ${SRC} HEAD = ${head} (the pin), tracked tree clean"
else
  if ! git -C "${SRC}" merge-base --is-ancestor "${SHA}" HEAD 2>/dev/null; then
    fail "DeepEP checkout ${SRC} HEAD ${head} does not descend from --sha ${SHA}"
  fi
  tree="$(git -C "${SRC}" rev-parse 'HEAD^{tree}')"
  if [ "${tree}" != "${PATCHED_TREE}" ]; then
    fail "DeepEP checkout ${SRC} HEAD^{tree} is ${tree}, expected --patched-tree ${PATCHED_TREE} (the pin ${SHA} with its patches)"
  fi
  echo "${PROG}: DeepEP ${SRC} HEAD = ${head}, descends from ${SHA}, tree ${tree} (the patched pin); ${n_dirty} uncommitted change(s): $(tr '\n' ';' < "${work}/dirty")"
fi

# fmt >= 11 (fmt/base.h): third-party/fmt is a git submodule; setup.py adds its include/ only.
fmt_header="${SRC}/third-party/fmt/include/fmt/base.h"
if [ ! -f "${fmt_header}" ]; then
  fmt_commit="$(git -C "${SRC}" ls-tree HEAD third-party/fmt 2>/dev/null | awk '{ print $3 }')"
  fail "${fmt_header} is missing: DeepEP needs fmt >= 11 headers from its git submodule third-party/fmt (fmtlib/fmt at ${fmt_commit:-the commit DeepEP records}). Fix: git -C ${SRC} submodule update --init --recursive (offline: put fmtlib/fmt's source at ${fmt_commit:-that commit} in ${SRC}/third-party/fmt). A system libfmt 9 (Debian 12) has no fmt/base.h and will not do."
fi
echo "${PROG}: fmt headers present: ${fmt_header}"

# ---- 2. the pinned NCCL and NVSHMEM wheels --------------------------------------------------------
NCCL_ROOT="${SITE}/nvidia/nccl"
NVSHMEM_ROOT="${SITE}/nvidia/nvshmem"
for dist in "nvidia_nccl_cu13-${NCCL_VERSION}" "nvidia_nvshmem_cu13-${NVSHMEM_VERSION}"; do
  if [ ! -d "${SITE}/${dist}.dist-info" ]; then
    find "${SITE}" -maxdepth 1 -name "${dist%%-*}-*.dist-info" -printf '%f ' > "${work}/found" 2>/dev/null || true
    found="$(cat "${work}/found")"
    fail "--site ${SITE} holds no ${dist}.dist-info (found: ${found:-none}): pip install --no-deps --target ${SITE} nvidia-nccl-cu13==${NCCL_VERSION} nvidia-nvshmem-cu13==${NVSHMEM_VERSION}"
  fi
done
NCCL_LIB="${NCCL_ROOT}/lib/libnccl.so.2"
for file in "${NCCL_LIB}" "${NCCL_ROOT}/include/nccl.h" "${NVSHMEM_ROOT}/lib/libnvshmem_device.a"; do
  if [ ! -s "${file}" ]; then fail "--site ${SITE}: ${file} is missing"; fi
done
if [ ! -d "${NVSHMEM_ROOT}/include" ]; then fail "--site ${SITE}: ${NVSHMEM_ROOT}/include is missing"; fi
find "${NVSHMEM_ROOT}/lib" -maxdepth 1 -name 'libnvshmem_host.so.*' -printf '%f\n' > "${work}/host"
nvshmem_host="$(sort "${work}/host" | sed -n 1p)"
if [ -z "${nvshmem_host}" ]; then fail "--site ${SITE}: no ${NVSHMEM_ROOT}/lib/libnvshmem_host.so.*"; fi

mkdir -p "$(dirname "${LOG}")"
: > "${LOG}"
LOG="$(cd "$(dirname "${LOG}")" && pwd -P)/$(basename "${LOG}")"
log "log ${LOG}; DeepEP ${SRC} at ${head}; site ${SITE} (nvidia-nccl-cu13 ${NCCL_VERSION}, nvidia-nvshmem-cu13 ${NVSHMEM_VERSION})"

# setup.py at b306af06 links `-l:libnccl.so` and `-l:libnvshmem_host.so`; the wheels ship only the
# SONAMEs (dd758ca resolves them itself and prefers the unversioned name when present).
link_unversioned() { # link_unversioned DIR NAME TARGET
  if [ -e "$1/$2" ]; then return 0; fi
  if ! ln -s "$3" "$1/$2" 2>>"${LOG}"; then fail "could not create $1/$2 -> $3 (is --site writable?)"; fi
  log "created $1/$2 -> $3 (the wheel ships only the SONAME)"
}
link_unversioned "${NCCL_ROOT}/lib" libnccl.so libnccl.so.2
link_unversioned "${NVSHMEM_ROOT}/lib" libnvshmem_host.so "${nvshmem_host}"

# ---- 3. the build --------------------------------------------------------------------------------
library_path="${NCCL_ROOT}/lib:${NVSHMEM_ROOT}/lib"
# -lcuda at link time on a machine without a driver (a docker build): the toolkit's stub library
if [ -d /usr/local/cuda/lib64/stubs ]; then library_path="${library_path}:/usr/local/cuda/lib64/stubs"; fi
library_path="${library_path}${LIBRARY_PATH:+:${LIBRARY_PATH}}"
build_env=(
  "TORCH_CUDA_ARCH_LIST=${ARCH_LIST}" "MAX_JOBS=${MAX_JOBS_ARG}"
  "EP_NCCL_ROOT_DIR=${NCCL_ROOT}" "NCCL_DIR=${NCCL_ROOT}"
  "EP_NVSHMEM_ROOT_DIR=${NVSHMEM_ROOT}" "NVSHMEM_DIR=${NVSHMEM_ROOT}"
  "LIBRARY_PATH=${library_path}"
)
log "build: cd ${SRC} && env ${build_env[*]} ${PYTHON} setup.py build_ext --inplace"
started="$(date +%s)"
rc=0
(cd "${SRC}" && env "${build_env[@]}" "${PYTHON}" setup.py build_ext --inplace) >> "${LOG}" 2>&1 || rc=$?
elapsed="$(( $(date +%s) - started ))"
if [ "${rc}" -ne 0 ]; then
  log "build exited ${rc} after ${elapsed} s"
  fail_with_log_tail "${PYTHON} setup.py build_ext --inplace exited ${rc} after ${elapsed} s"
fi
log "build exited 0 after ${elapsed} s"

# ---- 4. one extension ----------------------------------------------------------------------------
find "${SRC}/deep_ep" -maxdepth 1 -name '_C*.so' -print > "${work}/so"
n_so="$(wc -l < "${work}/so")"
if [ "${n_so}" -ne 1 ]; then
  log "deep_ep/_C*.so files: ${n_so}: $(tr '\n' ' ' < "${work}/so")"
  fail_with_log_tail "expected exactly one deep_ep/_C*.so in ${SRC}/deep_ep, found ${n_so}"
fi
log "built $(cat "${work}/so")"

# ---- 5. import with the pinned NCCL preloaded -------------------------------------------------------
if [ -n "${SKIP_IMPORT}" ]; then
  log "import check SKIPPED: ${SKIP_IMPORT}"
  log "OK: DeepEP ${head} built (not imported)"
  exit 0
fi
import_env=(
  "LD_PRELOAD=${NCCL_LIB}${LD_PRELOAD:+:${LD_PRELOAD}}"
  "EP_NCCL_ROOT_DIR=${NCCL_ROOT}" "NCCL_DIR=${NCCL_ROOT}"
  "EP_NVSHMEM_ROOT_DIR=${NVSHMEM_ROOT}" "NVSHMEM_DIR=${NVSHMEM_ROOT}"
  "PYTHONPATH=${SITE}:${SRC}${PYTHONPATH:+:${PYTHONPATH}}"
)
probe='import deep_ep
print("deep_ep", deep_ep.__file__, "version", getattr(deep_ep, "__version__", "?"))
print("ElasticBuffer", deep_ep.ElasticBuffer)
with open("/proc/self/maps") as maps:
    loaded = sorted({line.split()[-1] for line in maps if "libnccl" in line})
print("libnccl loaded:", " ".join(loaded))'
log "import: env ${import_env[*]} ${PYTHON} -c 'import deep_ep; deep_ep.ElasticBuffer'"
rc=0
(cd "${SRC}" && env "${import_env[@]}" "${PYTHON}" -c "${probe}") >> "${LOG}" 2>&1 || rc=$?
if [ "${rc}" -ne 0 ]; then
  fail_with_log_tail "import deep_ep; deep_ep.ElasticBuffer exited ${rc} (LD_PRELOAD=${NCCL_LIB})"
fi
n_ok="$(grep -c '^ElasticBuffer ' "${LOG}" || true)"
if [ "${n_ok}" -lt 1 ]; then
  fail_with_log_tail "the import printed no ElasticBuffer line"
fi
log "OK: DeepEP ${head} built and imported (deep_ep.ElasticBuffer) with ${NCCL_LIB} preloaded"
