#!/usr/bin/env bash
# Record a run of the guide on a GPU machine that has no network (the project's H200 machines):
# python3 there holds torch (cu130) and transformers; what the notebooks and AIPerf need beyond
# that travels as wheels. Usage, from the repository root on that machine:
#   scripts/gpu-run.sh RUN_ID WHEELS_NB WHEELS_AIPERF STAGES
# WHEELS_NB: wheels of papermill, ipykernel, nbclient, sh and transformers serve's extras;
# WHEELS_AIPERF: AIPerf 0.13.0 and what it needs beyond the machine's packages.
#
# Made on a machine with PyPI (2026-11-30; both together ~58 MiB, one device call), with
#   P="--only-binary=:all: --python-version 3.12 --implementation cp --platform any
#      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
#   pip download $P -d nb papermill==2.7.0 nbclient==0.11.0 nbformat==5.11.1 ipykernel==7.4.0 \
#     jupyter-client==8.10.0 sh==2.4.0 fastapi==0.136.3 starlette==1.10.0 uvicorn==0.54.0 \
#     openai==1.109.1 opentelemetry-api importlib-metadata
#   pip download $P -d aiperf aiperf==0.13.0
# then deleting from each the wheels of packages the H200 image already holds (its list is in the
# device tool's KINDS.md; pandas kept for AIPerf's pin), and from aiperf/ the ones its profile
# command never imports (plotly, dash*, kaleido, choreographer, optuna, alembic, sqlalchemy,
# mako, kopf, kubernetes_asyncio, textual, flask, itsdangerous, blinker, retrying, logistro,
# colorlog: checked by running `aiperf profile` with those modules blocked).
#
# SITES=DIR[:DIR...] (optional): folders installed with `pip install --no-deps --target`, put
# first on PYTHONPATH: vLLM 0.24.0 with the wheels requirements-gpu.txt names (unpacked by
# scripts/vllm-site.sh; engine '' then picks vLLM on 2+ GPUs), or the pinned transformers when the
# machine's own is older (its 5.17.0 lists only the Hugging Face cache at /v1/models, not the
# model it serves). Named SITES, not VLLM_*: vLLM warns about every unknown VLLM_ variable.
# DeepEP built in place needs no SITES entry: pass `-p deepep_dir DIR -p nccl_site SITE` and the
# stages put SITE, then DIR, on the PYTHONPATH of test_ep and of vLLM (lib.transport).
# Extra arguments after STAGES are passed to the runner (e.g. -p engine transformers).
set -euo pipefail
run_id=${1:?run id}
wheels_nb=${2:?folder of notebook wheels}
wheels_aiperf=${3:?folder of AIPerf wheels}
stages=${4:-00_cluster,03_kernel_test,04_serve,05_sweep,06_multicomm}
shift 4 || shift $#

site=/tmp/guide-site
if [[ ! -d "$site" ]]; then  # a second run on the same machine keeps the first one's install
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels_nb"/*.whl
fi
export PYTHONPATH="${SITES:+$SITES:}$site:$PWD"
# AIPerf apart, as on the CPU machines: its own site folder, behind the same path the guide
# calls (.venv-aiperf/bin/aiperf). No venv: python3 there is itself a venv, whose packages a
# nested venv would not see. torch hidden from it (scripts/aiperf_no_torch: AIPerf needs none,
# and transformers importing the machine's CUDA torch cost ~20 s per cell there).
aiperf_site=/tmp/aiperf-site
if [[ ! -x .venv-aiperf/bin/aiperf ]]; then
  if [[ ! -d "$aiperf_site" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$aiperf_site" \
      "$wheels_aiperf"/*.whl
  fi
  mkdir -p .venv-aiperf/bin
  cat > .venv-aiperf/bin/aiperf <<WRAPPER
#!/bin/sh
PYTHONPATH=$PWD/scripts/aiperf_no_torch:$aiperf_site exec $(command -v python3) -c 'import sys; from aiperf.cli import app; sys.argv[0] = "aiperf"; sys.exit(app())' "\$@"
WRAPPER
  chmod +x .venv-aiperf/bin/aiperf
fi
python3 -m lib.runner run --context local --run-id "$run_id" --stages "$stages" --no-book "$@"
