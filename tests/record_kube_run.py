"""Record the guide on the kube place against the test cluster, as a committed run.

    .venv/bin/python -m tests.record_kube_run kube-ctlplane-YYYYMMDD
    .venv/bin/python -m tests.record_kube_run kube-ctlplane-sglang-YYYYMMDD sglang
    .venv/bin/python -m tests.record_kube_run kube-ctlplane-trtllm-YYYYMMDD trtllm

With an engine other than vLLM, 04 and 05 only (06's levers are vLLM's), the engine's pods
logging what tests/compose.py composed from SGLang 0.5.19's formats, or the public
reproduction's recorded TensorRT-LLM 0.21.0 serve (its leader's mpirun output; the worker's
sshd line composed).

The control plane is real (tests/kubeplane.py: kube-apiserver, scheduler, controllers 1.20.2 on
127.0.0.1); the nodes are simulated by the kubelet double with outputs recorded on real hardware
or composed from them (tests/kube_env.py, tests/compose.py). The guide runs exactly as a person
runs it against EKS: `python -m lib.runner run --context kube ...` (papermill, every notebook),
KUBECONFIG pointing at the cluster. The run is written to results/<run_id>/ and sealed; add its
notebooks to results/REPLAYED to have `make test` replay it.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from lib import runner
from lib.stages import registry
from lib.stages.opening import LEVEL_ENV

try:
    import compose
    from kube_env import IMAGE, MODEL_CACHE, RECORDED_RUN, KubeEnv, model_config
except ImportError:
    from tests import compose
    from tests.kube_env import IMAGE, MODEL_CACHE, RECORDED_RUN, KubeEnv, model_config

STAGES = ["00_cluster", "01_public_roots", "02_image", "03_kernel_test", "04_serve", "05_sweep",
          "06_multicomm"]
LEVELS = (1, 2, 4)  # the recorded AIPerf 0.13 cells (40 requests, 4 warmup, 32 tokens out)
PARAMS = {
    "image": IMAGE, "model_cache_dir": MODEL_CACHE, "test_ep_tokens": "128",
    "concurrency": ",".join(map(str, LEVELS)), "repeats": "1", "ab_repeats": "2",
    "request_count": "40", "requests_per_slot": "0", "warmup_requests": "4",
    "warmup_full_batch": "false", "output_tokens": "32", "schedule_timeout_s": "30",
    "job_timeout_s": "120", "server_timeout_s": "120",
}


ENGINE_STAGES = ["04_serve", "05_sweep"]


def script_engine(env: KubeEnv, logs: Path, engine: str) -> None:
    """An engine's StatefulSet and its AIPerf Jobs (SGLang or TensorRT-LLM)."""
    p = registry.resolve("04_serve", {"context": "kube", "engine": engine})
    config = model_config(RECORDED_RUN / "model_config.json", experts=128, top_k=8)
    if engine == "sglang":
        pods = compose.compose_sglang_pods(logs / engine)
    else:
        pods = compose.compose_trtllm_pods(logs / engine)
    env.serve(engine, pods, model=p["model"], revision=p["model_revision"], config=config)
    env.aiperf_jobs([f"aiperf-{engine}-c{c}-r1" for c in LEVELS],
                    [f"concurrency_{c}" for c in LEVELS])


def script_the_cluster(env: KubeEnv, logs: Path) -> None:
    """What every pod of the run answers."""
    env.probes()
    env.verify()
    env.ranks("test-ep-at-128-tokens", compose.compose_test_ep(logs / "test_ep"))
    p = registry.resolve("04_serve", {"context": "kube"})
    config = model_config(RECORDED_RUN / "model_config.json", experts=128, top_k=8)
    for name in ("vllm", "vllm-epnc1-1", "vllm-epnc8-1", "vllm-epnc1-2"):
        env.serve(name, compose.compose_vllm_pods(logs / name), model=p["model"],
                  revision=p["model_revision"], config=config, metrics_reads=12,
                  answers="eager")
    cells = [f"concurrency_{c}" for c in LEVELS]
    env.aiperf_jobs([f"aiperf-vllm-c{c}-r1" for c in LEVELS], cells)
    for slug in ("vllm-epnc1", "vllm-epnc8"):
        for repeat in (1, 2):
            env.aiperf_jobs([f"aiperf-{slug}-c{c}-r{repeat}" for c in LEVELS], cells)


LEVEL = ("control plane real (kube-apiserver, scheduler and controllers 1.20.2 on 127.0.0.1), "
         "nodes simulated (a kubelet double), pod outputs recorded on 2x H200 or composed from "
         "them: not a measurement of any cluster")


ENGINE_LEVEL = ("control plane real (kube-apiserver, scheduler and controllers 1.20.2 on "
                "127.0.0.1), nodes simulated (a kubelet double), the engine's pod logs composed "
                "from its source's formats (SGLang) or recorded by the public reproduction "
                "(TensorRT-LLM), AIPerf's exports recorded: not a measurement of any cluster, "
                "nor of the engine")


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or (argv[1:] and argv[1] not in ("sglang", "trtllm")):
        print(__doc__, file=sys.stderr)
        return 2
    run_id, engine = argv[0], (argv[1] if argv[1:] else "vllm")
    stages, params = (STAGES, PARAMS) if engine == "vllm" else (
        ENGINE_STAGES, {**{k: v for k, v in PARAMS.items()
                           if k not in ("test_ep_tokens", "ab_repeats")}, "engine": engine})
    registry.check_run_request("kube", run_id, stages, params)
    os.environ[LEVEL_ENV] = LEVEL if engine == "vllm" else ENGINE_LEVEL  # what was real
    with tempfile.TemporaryDirectory(prefix="kube-run-") as work:
        with KubeEnv(Path(work)) as env:
            if engine == "vllm":
                script_the_cluster(env, Path(work) / "composed")
            else:
                script_engine(env, Path(work) / "composed", engine)
            run_dir, rc = runner.run_guide("kube", run_id, params, stages)
            left = env.objects_left()
    print(f"run {run_dir.name}: exit {rc}; objects left in the cluster: {left or 'none'}")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
