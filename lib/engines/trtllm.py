"""TensorRT-LLM as an engine (lib.engines.base): rendered and log-gated only.

What is known, and from where: the public reproduction (R, antonai-work/deepep-v2-efa-repro)
served Qwen3-30B-A3B-FP8 on 2x p5en with TensorRT-LLM 0.21.0 on 2026-07-07, and its committed
logs (../shared/fixtures/public-repro/results/trtllm-deepep-dropin-20260707/: serve_log_head.log,
provider_evidence.log, seam_evidence.log) hold its whole launch line: one `mpirun -np 16` from
node 0 over ssh port 2222 into both nodes, `-x` for every variable it forwards (among them
TRTLLM_CAN_USE_DEEP_EP=1 and TRTLLM_MOE_DISABLE_ALLTOALLV=0), then `trtllm-llmapi-launch
trtllm-serve serve MODEL --backend pytorch --tp_size 16 --ep_size 16 --host 0.0.0.0 --port 8000
--max_batch_size 16 --max_num_tokens 8192 --kv_cache_free_gpu_memory_fraction 0.7
--trust_remote_code --extra_llm_api_options FILE` (the file's content is in none of its logs,
so it is not rendered here). TensorRT-LLM's wheels are not on the registries reachable here
(PyPI holds 1.6 KB stubs pointing to pypi.nvidia.com; 0.21.0 pins torch <= 2.8, 1.2.1 torch
< 2.10, ANCHORS 7), so nothing of it has run here, and its own source was not read.

The shape on kube (R's): node 0 runs mpirun (the leader), every other node an sshd on port 2222
that mpirun reaches (a worker, ready once its ranks are spawned); the leader's output is every
rank's. On Slurm the scheduler launches the MPI world itself (`launch` "mpi_world"): one step of
a task per GPU over every node, `srun -l --mpi=pmix`, each task `trtllm-llmapi-launch
trtllm-serve serve ...` (role 'task'), as TensorRT-LLM's own example does
(examples/llm-api/llm_mgmn_trtllm_serve.sh, NVIDIA/TensorRT-LLM at b35ac1b: sbatch -N 2
--ntasks-per-node=8, then srun -l --mpi=pmix of trtllm-llmapi-launch trtllm-serve); the step's
output is every rank's, each line under its task's label. What its logs prove (every line below is in R's logs):

- TensorRT-LLM chose DeepEP: "[TRT-LLM] [RANK 0] [I] CutlassFusedMoE selects
  alltoall_method_type <AlltoallMethodType.DeepEP: 2>" (rank 0 only);
- every rank reached DeepEP V2: R's own layers print a line per rank with its rank and the
  world, "[trtllm-comm-bridge] lazy-initializing torch.distributed NCCL PG rank=R/16 ..." (the
  API shim) or "[deep-ep-v2-seam] initializing torch.distributed NCCL PG rank=R/16 ..." (the
  one-file seam, which also prints "constructing deep_ep.ElasticBuffer" per rank). Both are R's
  patches, which the guide cites and does not re-create: a stock TensorRT-LLM prints neither,
  so these gates read R's lanes;
- NCCL's EFA provider line per process (its logs hold no NCCL "Init COMPLETE" lines: ranks are
  tied to processes through the lines above, not through NCCL's);
- none of "Executor worker returned error" / "Engine loading failed" (what R's watcher stopped
  on; its logs hold no uvicorn line, so that the API is up is the place's readiness gate).

TensorRT-LLM 1.x moved `from deep_ep import Buffer` to `from tensorrt_llm.deep_ep import Buffer`
(its deep_ep_utils.py; ANCHORS 7), so R's drop-in does not carry over to 1.x unchanged.
"""
from __future__ import annotations

import re
from typing import Mapping

from lib.core.evidence import gate
from lib.engines import nccl_logs
from lib.engines.base import Engine, EngineSpec
from lib.engines.nccl_logs import lines_of, quote
from lib.engines.transport import DEFAULT_PLUGIN_PATH, transport_env

SSH_PORT = 2222  # R's worker sshd (trtllm/manifests/trtllm-bench-2pod.yaml, ANCHORS 2)
# R's serve flags, as its recorded launch line has them
SERVE_FLAGS = ("--backend", "pytorch", "--max_batch_size", "16", "--max_num_tokens", "8192",
               "--kv_cache_free_gpu_memory_fraction", "0.7", "--trust_remote_code")
ENGINE_ENV = {"TRTLLM_CAN_USE_DEEP_EP": "1", "TRTLLM_MOE_DISABLE_ALLTOALLV": "0",
              "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
              "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV"}
A2A_BACKENDS = ("deepep_v2",)  # R's lanes: DeepEP V2 through its shim or its seam

_METHOD_RE = re.compile(r"CutlassFusedMoE selects alltoall_method_type "
                        r"<AlltoallMethodType\.(\w+): \d+>")
_RANK_LINE_RE = re.compile(r"\[(trtllm-comm-bridge|deep-ep-v2-seam)\] (?:lazy-)?initializing "
                           r"torch\.distributed NCCL PG rank=(\d+)/(\d+)")
_ERROR_RE = re.compile(r"Executor worker returned error|Engine loading failed")
_FATAL_RE = re.compile(r"Executor worker returned error|Engine loading failed|Traceback "
                       r"\(most recent call last\)|CUDA error: |NCCL error|illegal memory access")


# srun --label's prefix of every line of a task ("<task>: "; lib.places.slurm.sbatch.world_argv)
_SRUN_LABEL_RE = re.compile(r"^\s*\d+: ")


def _traced(line: str) -> bool:
    """Whether a line is `set -x`'s echo of a command (its '+ '), under srun's task label or
    not (the world step on Slurm labels every line; mpirun's output on kube has none)."""
    return _SRUN_LABEL_RE.sub("", line, count=1).startswith("+ ")


def _hosts(spec: EngineSpec) -> list[str]:
    """Every node's address, from the leader's: the leader role runs on kube, where its place
    gives the leader pod's address, `<name>-0.<service>.<namespace>.svc`, and the hosts mpirun
    reaches are its siblings `<name>-k.<service>...`."""
    pod, dot, domain = (spec.rendezvous or "").partition(".")
    name = pod.rsplit("-", 1)[0]
    return [f"{name}-{k}{dot}{domain}" for k in range(spec.nodes)]


def trtllm_env(spec: EngineSpec) -> dict[str, str]:
    env = dict(ENGINE_ENV)
    env.update(transport_env(spec.transport, nccl_site=spec.nccl_site,
                             plugin_path=spec.plugin_path or DEFAULT_PLUGIN_PATH))
    env.update({str(k): str(v) for k, v in spec.extra_env.items()})
    return env


def trtllm_argv(spec: EngineSpec, env: Mapping[str, str]) -> list[str]:
    """One process of the serve: the backend is one of A2A_BACKENDS, what the stage's parameter
    model allows with engine trtllm (TrtllmEngine.backends)."""
    if spec.role == "worker":
        return ["/usr/sbin/sshd", "-D", "-e", "-p", str(SSH_PORT)]
    dp = spec.dp_size
    serve = ["trtllm-llmapi-launch", "trtllm-serve", "serve", spec.model, "--tp_size", str(dp),
             "--ep_size", str(dp), "--host", "0.0.0.0", "--port", str(spec.port), *SERVE_FLAGS]
    if spec.role == "task":  # one rank of the world srun launched (SLURM_PROCID its rank)
        return serve
    if spec.role == "local":
        return ["mpirun", "--allow-run-as-root", "-np", str(dp), *serve]
    hosts = ",".join(f"{h}:{spec.gpus_per_node}" for h in _hosts(spec))
    forwarded = [a for name in sorted(env) for a in ("-x", name)]
    return ["mpirun", "--allow-run-as-root", "-np", str(dp), "-H", hosts, "--mca",
            "plm_rsh_agent", f"ssh -p {SSH_PORT} -o BatchMode=yes -o StrictHostKeyChecking=no",
            *forwarded, *serve]


def method_gate(leader: str, *, log_name: str) -> dict:
    found = [(i, l, m.group(1)) for i, l in enumerate(lines_of(leader), 1)
             for m in [_METHOD_RE.search(l)] if m]
    got = found[0][2] if found else None
    return gate("trtllm_alltoall_method_deepep", got == "DeepEP", got, "DeepEP",
                f"CutlassFusedMoE selected AlltoallMethodType.{got}" if found else
                "no 'CutlassFusedMoE selects alltoall_method_type' line (rank 0 logs it)",
                [quote(log_name, i, l) for i, l, _ in found[:1]]).as_dict()


def ranks_gate(every: str, world: int, *, log_name: str) -> dict:
    found = [(i, l, m) for i, l in enumerate(lines_of(every), 1)
             for m in [_RANK_LINE_RE.search(l)] if m]
    ranks = sorted({int(m.group(2)) for _, _, m in found if int(m.group(3)) == world})
    lanes = sorted({m.group(1) for _, _, m in found})
    missing = [r for r in range(world) if r not in ranks]
    observed = {"ranks": ranks, "missing": missing, "lanes": lanes}
    if not found:
        reason = ("no '[trtllm-comm-bridge]' or '[deep-ep-v2-seam]' rank line: these lanes' "
                  "layers print one per rank")
    elif missing:
        reason = f"rank(s) {', '.join(map(str, missing))} of {world} printed no rank line"
    else:
        reason = f"every rank of {world} initialized its DeepEP process group ({', '.join(lanes)})"
    return gate("trtllm_deepep_rank_per_rank", not missing and bool(found), observed,
                {"ranks": f"0..{world - 1}"}, reason,
                [quote(log_name, i, l) for i, l, _ in found[:16]]).as_dict()


def no_executor_error_gate(leader: str, *, log_name: str) -> dict:
    """None of the lines R's watcher stopped on as a failure ("Executor worker returned error",
    "Engine loading failed"); `set -x`'s echo of that grep is not one. (That the API is up is
    the place's readiness gate: R's committed logs hold no uvicorn line to read.)"""
    errors = [(i, l) for i, l in enumerate(lines_of(leader), 1)
              if _ERROR_RE.search(l) and not _traced(l)]
    return gate("trtllm_no_executor_error", not errors, len(errors), 0,
                f"{len(errors)} executor error line(s)" if errors else
                "no executor error, no engine-loading failure",
                [quote(log_name, i, l) for i, l in errors[:4]]).as_dict()


class TrtllmEngine(Engine):
    name = "trtllm"
    title = "TensorRT-LLM"
    ready_path = "/health"
    proves_backend = True
    expert_parallel = True
    backends = A2A_BACKENDS
    level = "rendered and log-gated on the public reproduction's logs (never run here)"
    pin = "tensorrt_llm"
    log_name = "trtllm.log"
    launch = "mpi_world"
    settles_when_quiet = True  # its recorded log ends with no start-up line of its own

    def command(self, spec: EngineSpec) -> tuple[list[str], dict[str, str]]:
        env = trtllm_env(spec)
        return trtllm_argv(spec, env), env

    def process_words(self, spec: EngineSpec) -> list[str]:
        return ["trtllm-serve", "serve"]

    def log_gates(self, leader: str, logs: Mapping[str, str], spec: EngineSpec, *,
                  log_name: str, evidence: list[str], api_servers: int) -> list[dict]:
        every = "\n".join(logs.values())
        sources = ", ".join(evidence)
        return [method_gate(leader, log_name=log_name),
                ranks_gate(every, spec.dp_size, log_name=sources),
                nccl_logs.efa_provider_per_rank(every, spec.dp_size, log_name=sources),
                no_executor_error_gate(leader, log_name=log_name)]

    def first_fatal(self, text: str) -> str | None:
        for line in lines_of(text):
            if _FATAL_RE.search(line) and not _traced(line):
                return line.strip()
        return None
