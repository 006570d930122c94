"""The local place: this machine, every process real, started and stopped by the door.

Processes run as subprocesses: the torch benchmark under torchrun and DeepEP's test_ep (one
"node", this machine), `transformers serve` or vLLM over this machine's GPUs, AIPerf beside the
server. Its facts are this host's (/proc, /sys, nvidia-smi, kubectl and docker clients). The
engine a stage serves with by default is this machine's pick: vLLM where it imports and two or
more GPUs are present, else `transformers serve`.
"""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from lib.core.errors import Unsupported
from lib.core.evidence import gate, skip
from lib.engines import server as served, transformers, vllm_server
from lib.engines.devices import cuda_device_count
from lib.places.base import NodeNeeds, NodeRank, NodeRun, Place, PlaceSpec, RankJob, ServeSpec
from lib.engines.deepep import DEFAULT_MODE

HOST = "127.0.0.1"
BUILD_TIMEOUT_S = 4 * 3600.0  # docker build of the image (EFA installer, DeepEP, vLLM)
# docker build's named contexts (--build-context NAME=PATH, PATH from the repository root): the
# image's Layer 7b copies this guide's vLLM patch 0002 from guide-patches (docker/Dockerfile),
# so patches/ stays the one copy of it and the main context (docker/) stays as narrow as it is
BUILD_CONTEXTS = {"guide-patches": Path("patches")}


def vllm_here() -> tuple[int, bool]:
    """(CUDA GPUs torch sees, whether vllm is importable), without importing vllm."""
    has_vllm = importlib.util.find_spec("vllm") is not None
    if not has_vllm:  # no need to start CUDA (or import torch) to know the answer
        return 0, False
    try:
        import torch

        return torch.cuda.device_count(), True
    except ImportError:
        return 0, True


def engine_for_this_machine() -> str:
    """engine='' : 'vllm' where vllm imports and 2+ GPUs are present, else 'transformers'."""
    gpus, has_vllm = vllm_here()
    return "vllm" if has_vllm and gpus >= 2 else "transformers"


def engine_refusal_here(engine: str | None) -> str | None:
    """Why this machine cannot serve with `engine` (what the engine parameter may be instead,
    and what was found), or None: engine 'vllm' needs 2+ GPUs and vllm importable. Read before
    the run is opened (lib.stages.rules_places refuses it in the first cell), so nothing is
    recorded for a refused engine."""
    if engine != "vllm":
        return None
    gpus, has_vllm = vllm_here()
    if gpus < 2 or not has_vllm:
        return (f"'transformers' (or '') on this machine: engine 'vllm' needs 2 or more GPUs and "
                f"vllm importable; found {gpus} GPU(s) and vllm "
                f"{'importable' if has_vllm else 'not installed'}")
    return None


def meminfo_kib(text: str | None, key: str) -> int | None:
    match = re.search(rf"^{key}:\s+(\d+)", text or "", re.M)
    return int(match.group(1)) if match else None


# What 00 asks of this machine: GPUs, EFA, GPUDirect and hugepages are the cluster's facts; a
# local host without them runs the CPU paths (every reason below is the gate's SKIP reason).
LOCAL_NEEDS = NodeNeeds(
    gpus=None, efa=None, gdrdrv=False, hugepages=False,
    no_gpus="{gpus} GPU(s) here: the kernel test runs on gloo/CPU and serving on transformers "
            "serve; the GPU paths need 2 or more",
    no_efa="no EFA device under /sys/class/infiniband: the EFA transport is measured on the "
           "kube context only",
    no_gdrdrv="gdrdrv is not loaded here (/sys/module/gdrdrv/version absent); GPUDirect RDMA is "
              "a cluster fact",
    no_hugepages="none allocated here; only the EFA path needs them",
    no_cluster_access="the local context uses no cluster (kubectl client {kubectl})")


class LocalPlace(Place):
    kind = "local"
    what = "the local place (this machine)"
    engines = ("transformers", "vllm")
    gin = False  # no RDMA NIC here: DeepEP runs intranode with GIN off (EP_DISABLE_GIN=1)
    transport = "intranode_nvlink"  # one machine: NVLink, GIN off, NCCL 2.30.4 preloaded
    python = sys.executable
    shares_files = True
    one_machine = True

    @classmethod
    def engine_default(cls, spec: PlaceSpec) -> str:
        return engine_for_this_machine()

    @classmethod
    def engine_refusal(cls, spec: PlaceSpec) -> str | None:
        return engine_refusal_here(spec.engine)

    def gpus(self) -> int:
        return cuda_device_count(self.door)

    def node_needs(self) -> NodeNeeds:
        return LOCAL_NEEDS

    def host_facts(self) -> list[dict[str, Any]]:
        """This host, as one node: every value through the door."""
        door = self.door
        cpuinfo = door.read_text("/proc/cpuinfo")
        meminfo = door.read_text("/proc/meminfo")
        facts: dict = {
            "cpu_cores": len(re.findall(r"^processor\s*:", cpuinfo or "", re.M)),
            "cpu_model": (re.findall(r"^model name\s*:\s*(.+)$", cpuinfo or "", re.M)
                          or [None])[0],
            "memory_gib": round((meminfo_kib(meminfo, "MemTotal") or 0) / 2**20, 1),
            "hugepages_total": meminfo_kib(meminfo, "HugePages_Total"),
            "hugepage_size_kib": meminfo_kib(meminfo, "Hugepagesize"),
        }
        facts["gpus"] = self._gpu_facts()
        rdma = door.listdir("/sys/class/infiniband") or []
        facts["rdma_devices"] = rdma
        facts["efa_devices"] = [d for d in rdma if (door.read_text(
            f"/sys/class/infiniband/{d}/device/uevent") or "").find("DRIVER=efa") >= 0]
        facts["gdrdrv_version"] = (door.read_text("/sys/module/gdrdrv/version")
                                   or "").strip() or None
        kubectl = door.run(["kubectl", "version", "--client", "-o", "json"], timeout=30,
                           check=False)
        facts["kubectl_client"] = (
            json.loads(kubectl.stdout).get("clientVersion", {}).get("gitVersion")
            if kubectl.ok else None)
        docker = door.run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=30,
                          check=False)
        facts["docker_engine"] = docker.stdout.strip() if docker.ok else None
        facts["docker_error"] = None if docker.ok else (docker.stderr.strip().splitlines()
                                                        or [""])[0]
        return [facts]

    def _gpu_facts(self) -> list[dict]:
        if not self.door.which("nvidia-smi"):
            return []
        out = self.door.run(
            ["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
             "--format=csv,noheader,nounits"], timeout=60, check=False)
        gpus = []
        for line in out.stdout.splitlines() if out.ok else []:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 4:
                gpus.append({"index": int(parts[0]), "name": parts[1],
                             "memory_mib": int(float(parts[2])), "driver": parts[3]})
        return gpus

    def run_ranks(self, job: RankJob) -> list[NodeRun]:
        """One process for the one node (it spawns the ranks), rendezvous on loopback."""
        node = NodeRank(0, 1, HOST, self.door.free_port())
        call = self.door.run(job.argv(node), timeout=job.timeout_s, env=job.env(node),
                             cwd=job.cwd, check=False)
        streams = [f"calls/{self.stage.name}/{call.seq:04d}.stdout",
                   f"calls/{self.stage.name}/{call.seq:04d}.stderr"]
        return [NodeRun(0, call.rc, call.stdout, call.stderr, call.timed_out, streams)]

    def model(self, engine: str, announce: bool = False):
        """The seeded model, built here through the door (a replay never builds); `announce`:
        say so first (04 does; 05 and 06 build the model 04 built, silently)."""
        if engine not in self.engines:
            raise Unsupported(f"{self.what} serves with {', '.join(self.engines)}, not engine "
                              f"{engine!r} (it runs on a cluster place: kube, slurm, or plan)")
        if announce:
            print(f"building (or finding cached) the seeded MoE model for {engine}, seed "
                  f"{self.spec.seed}, {self.spec.model_layers} layers", flush=True)
        return transformers.build_model(self.stage, engine, seed=self.spec.seed,
                                        layers=self.spec.model_layers)

    @contextmanager
    def serve(self, spec: ServeSpec) -> Iterator[Any]:
        stage = self.stage
        model_dir = spec.model["model_dir"]
        if spec.engine != "vllm":
            with transformers.local_server(stage, model_dir, timeout_s=spec.timeout_s,
                                           **({"log_name": spec.log_name} if spec.log_name
                                              else {})) as server:
                yield server
            return
        gpus = spec.gpus if spec.gpus is not None else self.gpus()
        with vllm_server.vllm_server(
                stage, model_dir, gpus=gpus, backend=spec.backend,
                num_experts=spec.model["num_experts"], enforce_eager=spec.enforce_eager,
                nccl_site=self.nccl_site(), deepep_dir=self.deepep_dir(),
                expert_parallel=spec.expert_parallel, timeout_s=spec.timeout_s,
                ep_num_comms=spec.num_comms,
                deepep_v2_mode=self.spec.deepep_v2_mode or DEFAULT_MODE,
                gate_prefix=spec.gate_prefix,
                **({"log_name": spec.log_name} if spec.log_name else {})) as server:
            yield server

    def deepep_dir(self) -> str | None:
        return self.spec.deepep_dir or None  # a DeepEP built here (docker/build_deepep.sh)

    def nccl_site(self) -> str | None:
        return self.spec.nccl_site or None

    def read_model_config(self, server, model: dict[str, Any]):
        """The served model's config.json, here where it was built."""
        return served.read_model_config(self.stage, model["model_dir"])

    def server_rss(self, server) -> int | None:
        """Resident memory of a server's processes, from /proc through the door."""
        return served.server_rss(self.door, server)

    def build_image(self, *, dockerfile: Path, context: Path, tag: str, repo: Path) -> dict:
        """docker build where an engine answers (its whole log kept), then verify-image.sh in it."""
        info = self.door.run(["docker", "info"], timeout=60, check=False)
        if info.rc != 0:
            first = next((l.strip() for l in info.stderr.splitlines() if l.strip()), "no stderr")
            reason = f"no Docker engine: docker info exited {info.rc}: {first}"
            self.stage.add(skip("docker build", reason), skip("verify-image.sh in the built image", reason))
            return {"engine": False, "reason": reason}
        named = [f"--build-context={name}={path}" for name, path in BUILD_CONTEXTS.items()]
        built = self.door.run(["docker", "build", "--progress=plain", *named, "-f",
                               str(dockerfile), "-t", tag, str(context)], cwd=repo,
                              timeout=BUILD_TIMEOUT_S, check=False)
        log = self.stage.write_text("build.log", built.stdout + built.stderr)
        tail = [l for l in built.stderr.splitlines() if l.strip()][-3:]
        self.stage.add(gate("docker build", built.rc == 0 and not built.timed_out,
                       observed=f"rc {built.rc}" + (" (timed out)" if built.timed_out else ""),
                       expected="rc 0", reason="" if built.rc == 0 else " | ".join(tail),
                       evidence=[log]))
        if built.rc != 0:
            self.stage.add(skip("verify-image.sh in the built image", "the build failed (build.log)"))
            return {"engine": True, "tag": tag, "rc": built.rc}
        verified = self.door.run(["docker", "run", "--rm", tag, "/usr/local/bin/verify-image.sh"],
                                  timeout=600, check=False)
        out = self.stage.write_text("verify-image.txt", verified.stdout + verified.stderr)
        summary = next((l for l in reversed(verified.stdout.splitlines())
                        if l.startswith("verify-image:")), "no summary line")
        self.stage.add(gate("verify-image.sh in the built image", verified.rc == 0, observed=summary,
                       expected="every check PASS", reason="" if verified.rc == 0 else summary,
                       evidence=[out]))
        return {"engine": True, "tag": tag, "rc": built.rc, "verify_rc": verified.rc}
