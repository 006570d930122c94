"""The slurm place: a Slurm cluster through sbatch, srun, squeue, scontrol and scancel, each
call through the door (`partition`, `account`, `time_limit_min`, `schedule_timeout_s`,
`job_timeout_s`; the software from `image` through pyxis, or from `venv`).

What it runs (the argv and scripts: lib.places.batch):

- every multi-node piece of work is one allocation: `sbatch --parsable` of a holder over
  `nodes` whole nodes, one task per node (its job id comes back at once, so it is always known
  and cancellable), waited for until RUNNING for at most `schedule_timeout_s`; then ONE srun
  step across all its nodes, whose single bash wrapper picks each node's argv and env by
  `$SLURM_NODEID`; then `scancel <jobid>` and a wait until squeue no longer shows the job, so
  nothing is left queued or running. The cancel also runs when the step timed out, when the
  code between raised (KeyboardInterrupt included), and from `stage.on_exit` when the stage
  ends first. Why one step and not a step per node: srun starts every node's task at once or
  none, `--kill-on-bad-exit=1` ends the others as soon as one node fails (no node left waiting
  in a rendezvous until its timeout), and there is one process to wait on and time out;
- `host_facts()`: the partition's nodes from `sinfo -N`, then an allocation and one probe step
  (lib.places.batch.PROBE_SCRIPT, on the nodes themselves: the kernel's, /proc's and /sys's
  facts are the host's) and `scontrol -o show node <nodelist>` for the allocated nodes;
- `run_ranks(job)`: node N runs `job.argv(NodeRank(N, ...))` with `job.env(...)`; the
  rendezvous is node 0: its NodeAddr (`scontrol show hostnames <nodelist>`, then `scontrol
  show node`), on a free port picked here when that address is this machine's loopback (the
  local test cluster, whose nodes are all this host), else on RDZV_PORT (this machine cannot
  know which ports are free on node 0).

What it needs from the cluster's file system: the run's folder and the guide's checkout on a
file system every node shares at the same path (FSx for Lustre, NFS). Each node's output comes
back through srun's `--output`/`--error` files in the stage's folder
(`<job>-<jobid>-node<N>.out|.err`, and the node's exit code in `.rc`), read back through the
door once the job has ended; rank 0's result files (03's result.json) are written there too.
The step runs with `--chdir` = the checkout, so `python -m lib.bench.moe_a2a` imports from it.

Where the software comes from: with `image`, the step runs in it through pyxis/enroot
(`--container-image`, the run's folder and the checkout mounted at the same paths, `python3`
the image's); with `venv` (no image), `<venv>/bin/python` on the nodes; with neither,
run_ranks is Unsupported. pyxis is absent from the local test cluster, whose srun rejects
`--container-image` ("unrecognized option"): the image path is rendered (a plan shows it) and
checked there, not run. The node probe is bash on the nodes themselves, never in the image.

Serving (`model`, `serve`; stages 04, 05 and 06):

- `model(engine)`: for 'transformers' the seeded model, built here as the local place builds it
  (lib.engines.transformers.build_model through the door) into the checkout's `.cache/`, which
  is on the shared file system, so the nodes read the very files built here; for 'vllm' the
  cluster model named by its pin (pins.yaml's model and revision, as the kube place: nothing
  built here; the nodes download it, into `model_cache_dir` when given, else their own HF
  cache).
- `serve(spec)`: one allocation (the same holder) sized for the serve (the stage's `nodes` for
  vLLM, one node for transformers serve), then the server as steps inside it, each started
  through `door.start` (its srun is the door's handle; its whole output the stage's log):
  `srun --jobid J --overlap -N1 -n1 --nodelist <node>` (lib.places.batch.task_argv) running
  `transformers serve` (lib.engines.transformers.serve_argv) on node 0, or vLLM's leader on
  node 0 and a headless worker on every other node (lib.engines.vllm_args.vllm_serve roles
  leader/worker, DP = nodes x GPUs per node, one step per node). Ready by the local place's
  readiness loop (lib.engines.transformers.poll_until_ready through wait_ready: the leader's
  srun polled, `GET /v1/models` or `/health` at node 0's address); vLLM's logs then gated as
  the kube place gates its pods' (the backend, the EP split, NCCL's EFA provider on every rank).
  The server is reached from this machine on the cluster's network (`request` through
  door.http). `run_aiperf` runs AIPerf as one more step of the allocation on node 0, writing
  straight into the cell's folder on the shared file system, its output into the stage folder
  (`<cell>-<jobid>.out|.err`). On exit, normal or not: every step's srun stopped (door.stop),
  the allocation cancelled (scancel, then squeue until it is gone), and the gate `server
  stopped` (no step of it left in `squeue -s`, its port no longer answering).
- the arms of an A/B (lib.measure.serving: a serve whose gates carry the arm's name) share one
  allocation for the stage: side by side, or one after the other, interleaved with repeats,
  without giving the nodes back between blocks; each arm's steps are stopped when its block
  ends, the allocation is cancelled when the stage closes (stage.on_exit) or at once when an
  exception leaves a block. A lone serve (04, 05's sweep) cancels its allocation when its block
  ends. Arms side by side take `gpu_memory_utilization` 0.25 each (as on the local place) and
  the next ports.
- the server's processes are on a node: their resident memory is not read from here
  (`server_rss` None; 05's memory gate SKIPs) and the Server's `proc` is None once it is ready
  (its srun handle is `step`). `keep` is read by nothing here: a server never outlives its
  stage, and no allocation either.

`SlurmPlan` (below) is this place planning: the same code, its effects turned into records.
"""
from __future__ import annotations

import ipaddress
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from lib.core.door import REPO_ROOT, Background, CallResult
from lib.core.errors import DoorError, PlaceError
from lib.core.evidence import Gate, gate
from lib.engines import transformers, vllm_logs, vllm_server
from lib.engines.model_facts import routed_experts
from lib.engines.transport import unset_vars
from lib.engines.vllm_args import vllm_serve
import lib.places.batch as batch  # the module, not the package (no cycle through it)
from lib.places.base import (ClusterServer, NodeNeeds, NodeRank, NodeRun, Place, RankJob,
                             ServeSpec, Unsupported, saved_model_config)
from lib.places.instances import INSTANCE_TYPES
from lib.places.kube import _CONFIG_SCRIPT, AIPERF_ENV, AIPERF_IN_IMAGE, serve_gates
from lib.roots import pins as pins_mod

SUBMIT_TIMEOUT_S = 60.0  # sbatch, scancel: they return once slurmctld answers
QUERY_TIMEOUT_S = 30.0  # sinfo, squeue, scontrol
PROBE_TIMEOUT_S = 300.0  # the node probe step
RELEASE_TIMEOUT_S = 120.0  # scancel until squeue no longer shows the job (KillWait, epilogs)
IMAGE_DEEPEP_DIR = "/opt/DeepEP"  # where docker/Dockerfile builds DeepEP in the image
POLL_FIRST_S, POLL_MAX_S = 0.25, 5.0  # squeue while a job is pending or completing
STARTING = ("PENDING", "CONFIGURING", "REQUEUED", "RESIZING")  # not yet running, still coming
NO_JOB = ("runs no job beside a server on its own: AIPerf runs as a step of the serve's "
          "allocation (the server's run_aiperf)")
SHELLCHECK_TIMEOUT_S = 120.0
CONFIG_TIMEOUT_S = 300.0  # a step that reads the served model's config on node 0
ANSWER_TIMEOUT_S = 5.0  # is a stopped server's port still answering?
# Arms side by side in one allocation share the GPUs (as on the local place: three at 0.25)
ARM_GPU_MEMORY_UTILIZATION = vllm_server.GPU_MEMORY_UTILIZATION
IMAGE_NAME = "deepep-v2-efa"  # as 02 tags its build (lib.stages.image; lib.places.plan too)


class _NotAllocated(Exception):
    """The allocation was refused, or did not start in time (the job cancelled already)."""

    def __init__(self, reason: str, timed_out: bool = False):
        super().__init__(reason)
        self.timed_out = timed_out


@dataclass
class SlurmServer(ClusterServer):
    """A server as steps of an allocation: `url` is node 0's address and the port. For vLLM
    (`backend` set) the fields of lib.engines.vllm_server.VllmServer; for transformers serve
    `backend_gates` stays None (no log to prove a backend)."""
    jobid: str = ""
    host: str = ""  # node 0's address
    nodes: list[str] = field(default_factory=list)  # the nodes its steps run on, node 0 first
    step: Background | None = None  # the leader's srun (the door's handle of the server)
    steps: list[Background] = field(default_factory=list)  # every step's srun, node 0 first
    step_names: list[str] = field(default_factory=list)  # as `squeue -s` names them
    logs: list[Path] = field(default_factory=list)  # every step's output, node 0 first
    ready_path: str = "/v1/models"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def run_aiperf(self, stage, argv_for, *, timeout: float, out: Path, name: str):
        """AIPerf as a step of the server's allocation on node 0, writing into `out` on the
        shared file system. `argv_for(aiperf, artifact_dir, cores)` builds AIPerf's argv
        (lib.measure.sweep's one builder)."""
        return self.place.run_aiperf_step(self, argv_for, timeout=timeout, out=out, name=name)


@dataclass
class _Held:
    """The allocation a stage's serves run in: its job id, nodes in node-rank order, each
    one's scontrol facts, and how many serve blocks are open in it."""
    jobid: str
    nodes: int
    names: list[str]
    info: dict[str, dict[str, Any]]
    open: list[int] = field(default_factory=list)  # the port slots of the open serves


class SlurmPlace(Place):
    kind = "slurm"
    what = "the slurm place (Slurm through sbatch/srun)"
    gin = True  # p5en nodes: EFA, DeepEP's GIN on
    transport = "efa"  # lib.engines.transport's contract for the nodes' GPU processes
    shares_files = True  # the run's folder is on the nodes' shared file system (see above)

    submits = True  # a plan of this place (SlurmPlan) submits nothing

    def __init__(self, stage):
        super().__init__(stage)
        self._rows: list[dict[str, Any]] | None = None
        self._released: set[str] = set()
        self._serving: _Held | None = None
        self.jobs: list[str] = []  # every job id this place submitted, in order
        self.last_facts: list[dict[str, Any]] | None = None  # host_facts()' answer, every node

    # ---- parameters ---------------------------------------------------------------------------
    def _param(self, name: str, default: Any = None) -> Any:
        value = self.stage.params.get(name)
        return default if value is None else value

    def _venv(self) -> str | None:
        """`venv` as a path: as given when absolute, else inside the checkout (which the nodes
        share): a recorded run then names it relative to the repository and replays in any
        checkout."""
        venv = self._param("venv")
        if not venv or self._param("image"):
            return None
        path = Path(str(venv))
        return str(path if path.is_absolute() else REPO_ROOT / path).rstrip("/")

    @property
    def python(self) -> str:
        """The interpreter a node's process runs: the venv's (`venv`, no image), else the
        image's python3."""
        venv = self._venv()
        return f"{venv}/bin/python" if venv else "python3"

    def deepep_dir(self) -> str | None:
        """DeepEP on the nodes: the image's build, or the `deepep_dir` beside the venv."""
        if self._param("image"):
            return IMAGE_DEEPEP_DIR
        return self._param("deepep_dir") or None

    def nccl_site(self) -> str | None:
        """The NCCL to preload: none in the image (it pins its own), else `nccl_site`."""
        return None if self._param("image") else (self._param("nccl_site") or None)

    def _python(self) -> str:
        """The interpreter the nodes run; Unsupported when neither an image nor a venv says
        (once the cluster answered: PlaceError when it does not)."""
        if self._param("image") or self._param("venv"):
            return self.python
        self.nodes()  # a cluster that does not answer is said first: a FAIL, not this SKIP
        raise Unsupported(
            f"{self.what} runs ranks and servers with an `image` (pyxis's --container-image) "
            "or a `venv` (a Python environment on the nodes' shared file system); neither is "
            "given")

    def _program(self, name: str) -> str:
        """A console script on the nodes: the venv's (`<venv>/bin/<name>`), else the image's."""
        venv = self._venv()
        return f"{venv}/bin/{name}" if venv else name

    def _aiperf(self) -> tuple[str, dict[str, str]]:
        """AIPerf on the nodes and what it needs set: the repository's `.venv-aiperf` beside
        `venv` (its sibling, as in this checkout), else the image's /opt/aiperf."""
        venv = self._venv()
        if venv:
            return str(Path(venv).parent / ".venv-aiperf" / "bin" / "aiperf"), {}
        return AIPERF_IN_IMAGE, {"PYTHONPATH": AIPERF_ENV["PYTHONPATH"]}

    def _in_image(self) -> dict[str, Any]:
        """A step's image and mounts (the run's folder and the checkout at the same paths)."""
        image = self._param("image", "")
        return {"image": image,
                "mounts": (str(self.stage.run_dir), str(REPO_ROOT)) if image else ()}

    # ---- the cluster's nodes ------------------------------------------------------------------
    def where(self) -> str:
        """The cluster this place drives, as a refusal names it."""
        partition = self._param("partition", "")
        return f"slurm partition {partition!r}" if partition else "slurm's default partition"

    def _query(self, argv: list[str]) -> CallResult:
        call = self.door.run(argv, timeout=QUERY_TIMEOUT_S, check=False)
        if call.rc == 127:
            raise PlaceError(self.where(), "Slurm's clients (sinfo, sbatch, srun, squeue, "
                             "scontrol, scancel) are not on this machine", call)
        if not call.ok:
            raise PlaceError(self.where(), f"{argv[0]} did not answer", call)
        return call

    def nodes(self) -> list[dict[str, Any]]:
        """The partition's nodes (`partition`, else the default partition), from sinfo."""
        if self._rows is None:
            partition = self._param("partition", "")
            rows = batch.parse_sinfo(self._query(batch.sinfo_argv(partition)).stdout)
            if not partition and any(r["default"] for r in rows):
                rows = [r for r in rows if r["default"]]
            if not rows:
                raise PlaceError(self.where(), "sinfo lists no node in it")
            self._rows = rows
        return self._rows

    def gpus(self) -> int:
        """GPUs per node: the fewest the partition's nodes declare as GRES (0 without GRES)."""
        return min(r["gres_gpus"] for r in self.nodes())

    def node_needs(self) -> NodeNeeds:
        """A Slurm cluster of p5en nodes: GPUs and EFA devices as the instance type has them,
        gdrdrv >= 2.5 and hugepages, all required. A run that declares nodes without EFA
        (`efa_per_node` 0, e.g. CPU nodes) has no EFA path: gdrdrv and hugepages are then not
        required (a SKIP each, saying so); the GPU and EFA counts are gated as declared."""
        gpus, efa = self._param("gpus_per_node"), self._param("efa_per_node")
        kind = self._param("instance_type", "the instance type")
        rdma = efa != 0
        return NodeNeeds(
            gpus=gpus, efa=efa, gdrdrv=rdma, hugepages=rdma,
            no_gpus=f"{{gpus}} GPU(s) on this node: a {kind} node has {gpus}",
            no_efa=f"no EFA device under /sys/class/infiniband: a {kind} node has {efa}, and "
                   "DeepEP's inter-node all-to-all runs over them",
            no_gdrdrv=("gdrdrv is not loaded (/sys/module/gdrdrv/version absent): GPUDirect "
                       "RDMA over EFA needs gdrdrv >= 2.5 on every node") if rdma else
                      ("gdrdrv is not loaded; the run declares nodes without EFA "
                       "(efa_per_node 0): no GPUDirect RDMA over EFA to need it"),
            no_hugepages=("no hugepages allocated: the EFA path (libfabric) needs them" if rdma
                          else "none allocated; the run declares nodes without EFA "
                               "(efa_per_node 0): only the EFA path (libfabric) needs them"),
            no_cluster_access="the slurm context reaches its cluster through Slurm, not "
                              "kubectl (kubectl client {kubectl})")

    def host_facts(self) -> list[dict[str, Any]]:
        """Per allocated node, in node-rank order: the local place's node facts (from the probe
        step: cpu_cores, cpu_model, memory_gib, hugepages_total, hugepage_size_kib, gpus,
        rdma_devices, efa_devices, gdrdrv_version), its Slurm facts (node, partition,
        slurm_state from sinfo, scontrol_state, slurm_cpus, slurm_memory_mib, gres, gres_gpus,
        features, node_addr, node_hostname), and what 00's cluster gates read (cluster_access,
        ready, instance_type: the feature naming one, evidence: the probe's output file).
        This machine's clients (kubectl_client, docker_engine) are no node's facts: absent.
        Raises PlaceError when the nodes could not be allocated in time."""
        version = self._query(["sinfo", "--version"]).stdout.strip()
        rows = {r["node"]: r for r in self.nodes()}
        gpus, nodes = self.gpus(), int(self._param("nodes", 1))
        try:
            jobid = self._allocate("node probe", nodes, gpus)
        except _NotAllocated as why:
            raise PlaceError(self.where(), f"the node probe was not allocated: {why}") from None
        try:
            names, info = self._nodes_of(jobid)
            base = self.stage.path(f"probe-{jobid}")
            call = self._run_step(self._probe_argv(jobid, len(names), str(base), gpus),
                                  timeout=min(PROBE_TIMEOUT_S,
                                              self._param("job_timeout_s", PROBE_TIMEOUT_S)),
                                  label="the node probe")
        except _NotAllocated as why:
            raise PlaceError(self.where(), f"the node probe was not allocated: {why}") from None
        finally:
            self.release(jobid)
        report, facts = batch.srun_report(call.stderr), []
        access = (f"{version}: sbatch, srun, squeue, scontrol, scancel answered; partition "
                  f"{rows[names[0]]['partition'] if names[0] in rows else '?'}")
        for rank, name in enumerate(names):
            out = self.stage.rel(Path(f"{base}-node{rank}.out"))
            probed = batch.parse_probe(self.door.read_text(f"{base}-node{rank}.out"))
            slurm = {**rows.get(name, {}), **info.get(name, {})}
            slurm.pop("default", None)
            facts.append({
                "node": name, **slurm, **probed,
                "instance_type": next((f for f in slurm.get("features", [])
                                       if f in INSTANCE_TYPES), None),
                "ready": probed["probe_complete"] and batch.usable(slurm.get("slurm_state")),
                "cluster_access": access,
                "probe_rc": None if call.timed_out else report.get(rank, 0 if call.ok else None),
                "evidence": [out],
            })
        self.last_facts = facts
        return facts

    def _probe_argv(self, jobid: str, nodes: int, base: str, gpus: int) -> list[str]:
        """The probe step: bash on the nodes themselves (never in the image)."""
        return batch.step_argv(
            jobid=jobid, nodes=nodes, out_base=base,
            time_min=self._param("time_limit_min", 60), script=batch.probe_script(),
            script_name="guide-node-probe", chdir=str(self.stage.dir),
            gpus_per_node=gpus, kill_on_bad_exit=False)

    # ---- ranks --------------------------------------------------------------------------------
    def run_ranks(self, job: RankJob) -> list[NodeRun]:
        """One allocation of job.nodes nodes, one step, node N running job.argv/env of rank N;
        every node's exit code and whole output (from its --output/--error files)."""
        python = self._python()
        gpus = self.gpus()
        timeout = min(float(job.timeout_s), float(self._param("job_timeout_s", job.timeout_s)))
        try:
            jobid = self._allocate(job.name, job.nodes, gpus)
        except _NotAllocated as why:
            return self._never_ran(job, str(why), why.timed_out)
        try:
            names, info = self._nodes_of(jobid)
            addr = node_address(info, names[0])
            port = self.door.free_port() if _this_host(addr) else batch.RDZV_PORT
            per_node = []
            for rank in range(job.nodes):
                node = NodeRank(rank, job.nodes, addr, port)
                argv = [str(a) for a in job.argv(node)]
                if argv and argv[0] == sys.executable:  # this machine's interpreter: the nodes'
                    argv[0] = python
                per_node.append((argv, job.env(node)))
            base = str(self.stage.path(f"{batch.slug(job.name)}-{jobid}"))
            cpus = [info[n]["slurm_cpus"] for n in names if info.get(n, {}).get("slurm_cpus")]
            call = self._run_step(batch.step_argv(
                jobid=jobid, nodes=job.nodes, out_base=base,
                time_min=self._param("time_limit_min", 60),
                script=self._wrapper(job.name, per_node, base),
                script_name=f"guide-{batch.slug(job.name)}", chdir=str(job.cwd or REPO_ROOT),
                cpus_per_task=min(cpus) if cpus else None, gpus_per_node=gpus,
                **self._in_image()), timeout=timeout, label=f"{job.name} on {job.nodes} node(s)")
        except _NotAllocated as why:
            return self._never_ran(job, str(why), why.timed_out)
        finally:
            self.release(jobid)
        return self._node_runs(job, base, call)

    def _node_runs(self, job: RankJob, base: str, call: CallResult) -> list[NodeRun]:
        """Each node's files, read once the job has ended: its rc from the wrapper's .rc file,
        else from srun's own report (a task killed before it could write it)."""
        report = batch.srun_report(call.stderr)
        srun_stream = f"calls/{self.stage.name}/{call.seq:04d}.stderr"
        runs = []
        for rank in range(job.nodes):
            out = self.door.read_text(f"{base}-node{rank}.out")
            err = self.door.read_text(f"{base}-node{rank}.err")
            rc = batch.parse_rc(self.door.read_text(f"{base}-node{rank}.rc"))
            if rc is None:
                rc = report.get(rank)
            streams = [self.stage.rel(Path(f"{base}-node{rank}.{kind}"))
                       for kind, text in (("out", out), ("err", err)) if text is not None]
            # a step that timed out was cancelled: a node that had not exited 0 by then timed
            # out (its code, where the TERM trap wrote one, says how it was ended)
            runs.append(NodeRun(rank, rc, out or "",
                                err if err is not None else call.stderr,
                                call.timed_out and rc != 0, streams + [srun_stream]))
        return runs

    def _never_ran(self, job: RankJob, reason: str, timed_out: bool) -> list[NodeRun]:
        return [NodeRun(rank, None, "", reason, timed_out, []) for rank in range(job.nodes)]

    # ---- one allocation -----------------------------------------------------------------------
    def _allocate(self, label: str, nodes: int, gpus: int) -> str:
        """Submit the allocation; its job id (cancelled at the latest when the stage ends)."""
        call = self.door.run(self._alloc_argv(label, nodes, gpus), timeout=SUBMIT_TIMEOUT_S,
                             check=False)
        jobid = call.stdout.strip().split(";")[0] if call.ok else ""
        if not jobid.isdigit():
            raise _NotAllocated(f"sbatch refused the allocation of {nodes} node(s) (rc "
                                f"{call.rc}): {call.stderr.strip() or call.stdout.strip()}")
        self.jobs.append(jobid)
        self.stage.on_exit(lambda: self.release(jobid))
        self.stage.dir.mkdir(parents=True, exist_ok=True)  # where the nodes write their output
        return jobid

    def _alloc_argv(self, label: str, nodes: int, gpus: int) -> list[str]:
        return batch.alloc_argv(
            name=f"guide-{self.stage.name}-{batch.slug(label)}", nodes=nodes,
            time_min=self._param("time_limit_min", 60), partition=self._param("partition", ""),
            account=self._param("account", ""), gpus_per_node=gpus)

    def _wait_running(self, jobid: str) -> str:
        """The job's nodelist once it runs; _NotAllocated when it ends first or is still not
        running after `schedule_timeout_s` (the caller cancels it)."""
        limit = float(self._param("schedule_timeout_s", 900.0))
        deadline = self.door.now() + limit
        delay, last = POLL_FIRST_S, "not yet in squeue"
        while True:
            call = self.door.run(batch.queue_argv(jobid), timeout=QUERY_TIMEOUT_S, check=False)
            got = batch.parse_queue(call.stdout) if call.ok else None
            if got and got[0] == "RUNNING" and got[2]:
                return got[2]
            if got is None and (call.ok or "Invalid job id" in call.stderr):
                raise _NotAllocated(f"job {jobid} left the queue before it ran ({last})")
            if got is not None:
                if got[0] not in STARTING and got[0] != "RUNNING":
                    raise _NotAllocated(f"job {jobid} is {got[0]} ({got[1]}) before it ran")
                last = f"{got[0]}, reason {got[1]}"
            if self.door.now() > deadline:
                raise _NotAllocated(f"job {jobid} was not running after schedule_timeout_s = "
                                    f"{limit:g} s ({last}); cancelled", timed_out=True)
            self.door.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)

    def _nodes_of(self, jobid: str) -> tuple[list[str], dict[str, dict[str, Any]]]:
        """The allocation's nodes once it runs (_NotAllocated when it does not)."""
        return self._allocated_nodes(self._wait_running(jobid))

    def _wrapper(self, name: str, per_node: list[tuple[list[str], dict[str, str]]],
                 base: str) -> str:
        return batch.wrapper_script(name, per_node, base)

    def _run_step(self, argv: list[str], *, timeout: float, label: str) -> CallResult:
        """One step run to its end from this machine (srun waits for its tasks)."""
        return self.door.run(argv, timeout=timeout, check=False)

    def _start_step(self, argv: list[str], *, log_path: Path, label: str) -> Background | None:
        """One step started and left running (a server's): srun in its own session, its
        output into `log_path`."""
        return self.door.start(argv, log_path=log_path)

    def _allocated_nodes(self, nodelist: str) -> tuple[list[str], dict[str, dict[str, Any]]]:
        """The allocation's node names in node-rank order, and each one's scontrol facts."""
        names = self._query(batch.hostnames_argv(nodelist)).stdout.split()
        info = batch.parse_nodes(self._query(batch.show_node_argv(nodelist)).stdout)
        if not names:
            raise _NotAllocated(f"scontrol show hostnames {nodelist} named no node")
        return names, info

    def release(self, jobid: str) -> bool | None:
        """scancel the job, then wait until squeue no longer shows it (its processes are gone
        once it has left COMPLETING): whether it is gone (None: released before). Once per
        job: the stage's on_exit asks again."""
        if jobid in self._released:
            return None
        self._released.add(jobid)
        self.door.run(batch.cancel_argv(jobid), timeout=SUBMIT_TIMEOUT_S, check=False)
        deadline = self.door.now() + RELEASE_TIMEOUT_S
        delay = POLL_FIRST_S
        while True:
            call = self.door.run(batch.queue_argv(jobid), timeout=QUERY_TIMEOUT_S, check=False)
            if batch.parse_queue(call.stdout) is None and (call.ok or "Invalid job id"
                                                           in call.stderr):
                return True
            if self.door.now() > deadline:
                return False
            self.door.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)

    def _steps(self, jobid: str) -> list[tuple[str, str]] | None:
        """The job's steps (id, name) in `squeue -s`; [] once the job is gone, None when squeue
        could not say."""
        call = self.door.run(batch.steps_argv(jobid), timeout=QUERY_TIMEOUT_S, check=False)
        if call.ok:
            return batch.parse_steps(call.stdout)
        return [] if "Invalid job id" in call.stderr else None

    def _cancel_steps(self, jobid: str, names: list[str]) -> None:
        """scancel the steps of the job named `names` (a step whose srun was ended, or timed
        out, may outlive it)."""
        for step, name in self._steps(jobid) or []:
            if name in names:
                self.door.run(batch.cancel_argv(step), timeout=SUBMIT_TIMEOUT_S, check=False)

    def _steps_gone(self, jobid: str, names: list[str]) -> list[str] | None:
        """Until no step named `names` is left in `squeue -s` (each one still there cancelled
        by its id, once): the ones left at the deadline ([] when gone; None when squeue could
        not say)."""
        deadline = self.door.now() + RELEASE_TIMEOUT_S
        delay, cancelled = POLL_FIRST_S, False
        while True:
            steps = self._steps(jobid)
            left = None if steps is None else sorted(s for s, n in steps if n in names)
            if not left or self.door.now() > deadline:
                return left
            if left and not cancelled:  # its srun is gone, the step not yet: ended by its id
                for step in left:
                    self.door.run(batch.cancel_argv(step), timeout=SUBMIT_TIMEOUT_S,
                                  check=False)
                cancelled = True
            self.door.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)

    # ---- serving ------------------------------------------------------------------------------
    def model(self, engine: str, announce: bool = False):
        """(the model to serve, the gate of how it was had). transformers: the seeded model,
        built here through the door as the local place builds it, into the checkout's `.cache/`
        on the shared file system (the nodes read the files built here); vllm: the cluster
        model named by its pin, as the kube place (nothing built). Unsupported before any call
        when the nodes have nothing to serve with (neither `image` nor `venv`)."""
        self._python()
        if engine != "vllm":
            if announce:
                print(f"building (or finding cached) the seeded MoE model for {engine}, seed "
                      f"{self.stage['seed']}, {self.stage['model_layers']} layers, in the "
                      "checkout's .cache/ on the shared file system", flush=True)
            return transformers.build_model(self.stage, engine)
        p = self.stage.params
        experts = routed_experts(p["model"])
        info = {"model_dir": p["model"], "revision": p["model_revision"],
                "num_experts": experts, "config_hash": p["model_revision"],
                "parameters": None, "seed": None, "built": False}
        if announce:
            print(f"serving {p['model']} at revision {p['model_revision']} (pins.yaml)",
                  flush=True)
        cache = p.get("model_cache_dir") or ""
        return info, gate("model named by its pin", bool(p["model"] and p["model_revision"]),
                          {"model": p["model"], "revision": p["model_revision"],
                           "routed_experts": experts}, {"revision": "40 hex"},
                          "the nodes download it at this revision"
                          + (f" into {cache}" if cache else " into their own HF cache"), [])

    def _serving_allocation(self, nodes: int, gpus: int) -> _Held:
        """The stage's serving allocation of `nodes` nodes: the one held, else a new one."""
        held = self._serving
        if held and held.jobid not in self._released and held.nodes == nodes:
            return held
        if held and not held.open:
            self.release(held.jobid)  # another size: its nodes back first
        jobid = self._allocate("serve", nodes, gpus)
        try:
            names, info = self._nodes_of(jobid)
        except BaseException:
            self.release(jobid)
            raise
        self._serving = _Held(jobid, nodes, names, info)
        return self._serving

    @contextmanager
    def serve(self, spec: ServeSpec) -> Iterator[SlurmServer]:
        """The server as steps of an allocation (see the module's docstring); yields it even
        when it is not ready (`ready` False, its FAIL gate added)."""
        stage, door = self.stage, self.door
        vllm = spec.engine == "vllm"
        python = self._python()
        gpus = (spec.gpus if spec.gpus is not None else self.gpus()) if vllm else 0
        nodes = int(self._param("nodes", 1)) if vllm else 1
        lone = not spec.gate_prefix
        prefix = f"{spec.gate_prefix}: " if spec.gate_prefix else ""
        log_name = spec.log_name or (vllm_server.LOG_NAME if vllm else "server.log")
        server = SlurmServer(str(spec.model["model_dir"]), 0, stage.path(log_name),
                             device="cuda" if vllm else "slurm", place=self,
                             backend=spec.backend if vllm else "",
                             gpus=nodes * gpus if vllm else 0,
                             ready_path=vllm_server.READY_PATH if vllm else "/v1/models")

        def add(g: Gate | dict | None) -> None:
            if g is None:
                return
            g = g if isinstance(g, Gate) else Gate(**g)
            if prefix:
                g = Gate(prefix + g.gate, g.status, g.observed, g.expected, g.reason, g.evidence)
            server.gates.append(g)
            stage.add(g)

        try:
            held = self._serving_allocation(nodes, gpus)
        except _NotAllocated as why:
            add(gate("server ready", False, {"allocated": False}, "listening",
                     f"the nodes of the serve were not allocated: {why}", []))
            yield server
            return
        slot = next(k for k in range(len(held.open) + 1) if k not in held.open)
        held.open.append(slot)
        server.jobid, server.nodes = held.jobid, held.names[:nodes]
        server.host = node_address(held.info, held.names[0])
        here = _this_host(server.host)
        server.port = door.free_port() if here else batch.SERVE_PORT + slot
        failed = False

        def backstop() -> None:
            if not server.stopped:
                self._stop_server(server, release=True)

        try:
            steps = (self._vllm_steps(spec, server, python, gpus, slot, here, lone) if vllm
                     else self._transformers_steps(server, here))
            if self.submits:
                stage.on_exit(backstop)
            started, unstarted = door.now(), None
            for node, argv, log_path in steps:
                command = argv[next(i for i, a in enumerate(argv) if i and a[:2] != "--"):]
                print(f"{'starting' if self.submits else 'planning'} a step on {node} of "
                      f"allocation {held.jobid}: {door.norm(' '.join(command))[:400]}",
                      flush=True)
                try:
                    handle = self._start_step(argv, log_path=log_path,
                                              label=f"{prefix}the server on {node}")
                except DoorError as exc:  # srun could not be started here at all
                    unstarted = f"could not start the step on {node}: {exc}"
                    break
                server.logs.append(log_path)
                if handle is not None:
                    server.steps.append(handle)
            server.step = server.steps[0] if server.steps else None
            if unstarted:
                add(gate("server ready", False, {"started": False}, "listening", unstarted, []))
            else:
                self._wait_ready(server, spec, add, started)
            yield server
        except BaseException:
            failed = True
            raise
        finally:
            held.open.remove(slot)
            release = (lone or failed) and not held.open
            if self.submits:
                add(self._stop_server(server, release=release))
            elif release:
                self.release(held.jobid)
            if release and self._serving is held:
                self._serving = None

    def _transformers_steps(self, server: SlurmServer, here: bool) -> list[tuple]:
        """transformers serve on node 0 (lib.engines.transformers.serve_argv, the one builder:
        the nodes' `transformers`, listening on every address unless node 0 is this host)."""
        argv = transformers.serve_argv(server.model_dir, server.port, None, "cpu")
        argv[0] = self._program("transformers")
        if not here:  # reached from this machine and the AIPerf step over the network
            argv[argv.index("--host") + 1] = "0.0.0.0"
        if not self.stage.replay and self.submits:
            # transformers 5.17 answers /v1/models with 500 unless the hub cache folder exists
            (transformers.HF_HOME / "hub").mkdir(parents=True, exist_ok=True)
        name = f"guide-{self.stage.name}-{batch.slug(server.log_path.stem)}"
        server.step_names = [name]
        return [(server.nodes[0], batch.task_argv(
            jobid=server.jobid, node=server.nodes[0], name=name,
            time_min=self._param("time_limit_min", 60), chdir=str(REPO_ROOT), argv=argv,
            env=transformers.serve_env(), **self._in_image()), server.log_path)]

    def _vllm_steps(self, spec: ServeSpec, server: SlurmServer, python: str, gpus: int,
                    slot: int, here: bool, lone: bool) -> list[tuple]:
        """vLLM's leader on node 0 and a headless worker on every other node, one step each,
        argv and env from lib.engines.vllm_args.vllm_serve (the one builder)."""
        p = self.stage.params
        nodes = len(server.nodes)
        rpc = self.door.free_port() if here else batch.DP_RPC_PORT + slot
        revision = p.get("model_revision") or ""
        stem = server.log_path.stem
        steps = []
        for ordinal, node in enumerate(server.nodes):
            role = "leader" if ordinal == 0 else "worker"
            argv, env = vllm_serve(
                role, model=server.model_dir, backend=spec.backend, dp_size=nodes * gpus,
                dp_size_local=gpus, dp_start_rank=ordinal * gpus, dp_address=server.host,
                dp_rpc_port=rpc, port=server.port, enforce_eager=spec.enforce_eager,
                gpu_memory_utilization=None if lone else ARM_GPU_MEMORY_UTILIZATION,
                ep_num_comms=spec.num_comms, transport=self.transport,
                nccl_site=self.nccl_site(), num_experts=spec.model.get("num_experts"),
                python=python, expert_parallel=spec.expert_parallel)
            if revision:  # weights and tokenizer at the pinned revision (as the kube place)
                argv += ["--revision", revision, "--tokenizer-revision", revision]
            if p.get("model_cache_dir"):
                env["HF_HOME"] = p["model_cache_dir"]
            if ordinal == 0:
                server.argv, server.env = list(argv), dict(env)
            name = f"guide-{self.stage.name}-{batch.slug(stem)}-node{ordinal}"
            server.step_names.append(name)
            log_path = server.log_path if ordinal == 0 else server.log_path.with_name(
                f"{stem}-node{ordinal}.log")
            steps.append((node, batch.task_argv(
                jobid=server.jobid, node=node, name=name,
                time_min=self._param("time_limit_min", 60), chdir=str(REPO_ROOT), argv=argv,
                env=env, unset=unset_vars(self.transport), gpus_per_node=gpus,
                **self._in_image()), log_path))
        return steps

    def _wait_ready(self, server: SlurmServer, spec: ServeSpec, add, started: float) -> None:
        """The local place's readiness loop on the leader's srun and node 0's port; for vLLM
        then its logs gated (every node's), as the kube place gates its pods'."""
        stage = self.stage
        server.proc = server.step  # polled while it comes up: a step that ends ends the wait
        try:
            if spec.engine == "vllm":
                add(vllm_server.wait_ready(stage, server, spec.timeout_s))
            else:
                add(transformers.wait_ready(stage, server, spec.timeout_s))
        finally:
            server.proc = None  # its processes are on a node: none of them is read here
        if spec.engine != "vllm" or not server.ready:
            return
        gpus_per_node = server.gpus // max(len(server.nodes), 1)
        leader = self._settled_log(server, gpus_per_node, started, spec.timeout_s)
        logs = {stage.rel(server.log_path): leader}
        for path in server.logs[1:]:
            logs[stage.rel(path)] = self.door.read_text(path) or ""
        server.startup_s = vllm_logs.startup_seconds(leader)
        evidence = list(logs)
        server.backend_gates = serve_gates(
            leader, logs, backend=spec.backend, dp_size=server.gpus,
            num_experts=spec.model.get("num_experts"), enforce_eager=spec.enforce_eager,
            api_servers=gpus_per_node, log_name=evidence[0], evidence=evidence)
        for g in server.backend_gates:
            add(g)

    def _settled_log(self, server: SlurmServer, api_servers: int, started: float,
                     timeout_s: float) -> str:
        """The leader's log once each of its API servers (one per local DP rank) logged its
        startup, or as it is at the deadline."""
        door = self.door
        while True:
            text = door.read_text(server.log_path) or ""
            if (text.count(vllm_server.STARTUP_LINE) >= api_servers
                    or door.now() - started >= timeout_s):
                return text
            door.sleep(transformers.POLL_INTERVAL_S)

    def _stop_server(self, server: SlurmServer, *, release: bool) -> Gate | None:
        """Every step's srun stopped (door.stop: TERM, then KILL; srun ends its step), the
        allocation cancelled when `release`, then what is left: the server's steps in `squeue
        -s`, its port answering from here."""
        if server.stopped:
            return None
        server.stopped = True
        door = self.door
        codes = [door.stop(h) for h in server.steps]
        exited = all(door.poll(h) is not None for h in server.steps)
        gone = self.release(server.jobid) if release else None
        left = self._steps_gone(server.jobid, server.step_names)
        answer = door.http("GET", server.url + server.ready_path, timeout=ANSWER_TIMEOUT_S)
        answering = answer.status is not None
        ok = exited and left == [] and not answering and gone is not False
        observed = {"exit_codes": codes, "steps_left": left, "port_answering": answering}
        if release:
            observed["allocation_gone"] = gone
        print(f"server stopped (srun exit {', '.join(map(str, codes)) or 'none'}); "
              f"{'allocation ' + server.jobid + ' cancelled; ' if release else ''}port "
              f"{server.port} on {server.nodes[0] if server.nodes else '?'} "
              f"{'still answering' if answering else 'closed'}", flush=True)
        return gate("server stopped", ok, observed,
                    {"steps_left": [], "port_answering": False,
                     **({"allocation_gone": True} if release else {})},
                    f"{len(codes)} step(s) of job {server.jobid} stopped by their srun"
                    + (", the allocation cancelled (scancel) and gone from squeue" if release
                       else "; the allocation stays for the stage's other arms")
                    + f"; no step of the server in squeue -s: {left == []}; port "
                    f"{server.port} {'still answering' if answering else 'closed'}",
                    [self.stage.rel(p) for p in server.logs] or [])

    def read_model_config(self, server, model: dict[str, Any]):
        """The served model's config.json: transformers, the seeded model's file here (the
        shared file system); vLLM, read on node 0 where it downloaded it (a step, offline),
        kept as the stage's model_config.json."""
        if not getattr(server, "backend", ""):
            return transformers.read_model_config(self.stage, model["model_dir"])
        p = self.stage.params
        env = {"HF_HUB_OFFLINE": "1", **({"HF_HOME": p["model_cache_dir"]}
                                         if p.get("model_cache_dir") else {})}
        call = self._run_step(batch.task_argv(
            jobid=server.jobid, node=server.nodes[0],
            name=f"guide-{self.stage.name}-model-config",
            time_min=self._param("time_limit_min", 60), chdir=str(REPO_ROOT),
            argv=[self.python, "-c", _CONFIG_SCRIPT, model["model_dir"],
                  p.get("model_revision") or "main"], env=env, **self._in_image()),
            timeout=CONFIG_TIMEOUT_S, label="the served model's config.json")
        return saved_model_config(self.stage, call)

    def run_aiperf_step(self, server: SlurmServer, argv_for, *, timeout: float, out: Path,
                        name: str) -> CallResult:
        """One AIPerf cell as a step of the server's allocation on node 0, against node 0's
        address; AIPerf writes its files straight into `out` (the cell's folder, on the shared
        file system) and its output into `<name>-<jobid>.out|.err` in the stage folder. A
        CallResult of the step, with `streams` its output files (and srun's own report)."""
        from lib.measure import sweep  # AIPerf's environment (lib.measure: no import at load)

        stage = self.stage
        aiperf, extra = self._aiperf()
        argv = argv_for(aiperf, str(out), None)
        env = {**sweep.aiperf_env(stage.path(sweep.MMAP_FOLDER)), **extra}
        base = stage.path(f"{batch.slug(name)}-{server.jobid}")
        step_name = f"guide-{stage.name}-{batch.slug(name)}"
        if not stage.replay and self.submits:
            out.mkdir(parents=True, exist_ok=True)
        call = self._run_step(batch.task_argv(
            jobid=server.jobid, node=server.nodes[0], name=step_name,
            time_min=self._param("time_limit_min", 60), chdir=str(REPO_ROOT), argv=argv,
            env=env, output=f"{base}.out", error=f"{base}.err", **self._in_image()),
            timeout=timeout, label=f"AIPerf {name}")
        if call.timed_out:  # srun was ended from here: its step is ended by its id
            self._cancel_steps(server.jobid, [step_name])
        stdout = self.door.read_text(f"{base}.out")
        stderr = self.door.read_text(f"{base}.err")
        result = CallResult(call.argv, call.rc, stdout or "",
                            (stderr or "") + call.stderr, call.duration_s, call.timed_out,
                            call.seq)
        result.streams = ([stage.rel(Path(f"{base}.{kind}")) for kind, text
                           in (("out", stdout), ("err", stderr)) if text is not None]
                          + [f"calls/{stage.name}/{call.seq:04d}.stderr"])
        return result

    def run_job(self, argv: list[str], *, env: dict[str, str], timeout_s: float):
        raise Unsupported(f"{self.what} {NO_JOB}")


class SlurmPlan(SlurmPlace):
    """The slurm place's own code, planning: every sbatch, srun and scancel recorded
    (`door.plan`), every step's script and each allocation's batch script written into the
    stage's `scripts/` and checked by shellcheck (a gate each); nothing submitted, nothing
    waited for: the first wait (an allocation's step to end, a server to be ready, the nodes'
    probe) raises Unsupported with the plan's one reason.

    What a plan cannot know is a placeholder, said once in the transcript (`# ...`): the job
    ids (`<job-N>`), the nodes (`node-0`, ... as their names and addresses), the image when
    neither `image` nor `venv` is given (02's tag for these pins), and, in the written scripts,
    the run's folder and the checkout (`{run}`, `{repo}`: on the shared file system)."""
    kind = "plan"
    target = "slurm"
    submits = False

    def __init__(self, stage):
        super().__init__(stage)
        self.what = "a plan for the slurm place (nothing is submitted to a cluster)"
        self.notes: list[str] = []
        self._planned: dict[str, dict[str, Any]] = {}  # job id -> its label, sbatch, steps
        self._files = 0

    def _not_run(self, what: str) -> Unsupported:
        return Unsupported(f"plan for slurm: {what} is planned, not run (context plan submits "
                           "nothing to a cluster); the scripts are in scripts/, shellchecked, "
                           "and the sbatch/srun/scancel lines in the transcript")

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            self.door.plan(["#", text], note="a placeholder of the plan")

    # ---- what a plan cannot know ----------------------------------------------------------
    def _param(self, name: str, default: Any = None) -> Any:
        value = super()._param(name, default)
        if name == "image" and not value and not super()._param("venv"):
            value = planned_image()
            self._note(f"image: {value} (02's tag for these pins; give -p image "
                       "<registry>/<name>@sha256:... or -p venv /shared/path/.venv)")
        return value

    def gpus(self) -> int:
        return int(self.stage["gpus_per_node"] or 0)

    def _nodes_of(self, jobid: str) -> tuple[list[str], dict[str, dict[str, Any]]]:
        nodes = int(self._planned[jobid]["nodes"])
        names = [f"node-{k}" for k in range(nodes)]
        self._note("nodes: node-0, node-1, ... stand for the nodes Slurm allocates, in node-rank "
                   "order (scontrol show hostnames names them; their NodeAddr is node 0's "
                   "address)")
        return names, {n: {"node_addr": n} for n in names}

    def host_facts(self) -> list[dict[str, Any]]:
        nodes, gpus = int(self._param("nodes", 1)), self.gpus()
        jobid = self._allocate("node probe", nodes, gpus)
        try:
            names, _ = self._nodes_of(jobid)
            self._run_step(self._probe_argv(jobid, len(names),
                                            str(self.stage.path(f"probe-{jobid}")), gpus),
                           timeout=PROBE_TIMEOUT_S, label="the node probe")
        finally:
            self.release(jobid)
        raise self._not_run("the node probe")  # pragma: no cover (_run_step raised)

    def model(self, engine: str, announce: bool = False):
        if engine != "vllm":
            self._python()
            self.door.plan([sys.executable, "-m", "lib.models", "build", "--seed",
                            str(self.stage["seed"]), "--layers", str(self.stage["model_layers"])],
                           note="the seeded model, built where the guide runs, into the "
                                "checkout's .cache/ on the shared file system")
            raise self._not_run("building the seeded model")
        return super().model(engine, announce)

    # ---- effects turned into records ------------------------------------------------------
    def _allocate(self, label: str, nodes: int, gpus: int) -> str:
        argv = self._alloc_argv(label, nodes, gpus)
        jobid = f"<job-{len(self.jobs) + 1}>"
        self._note("<job-N>: the job id sbatch --parsable prints for the N-th allocation")
        self.door.plan(argv, note=f"allocate {nodes} node(s): {label}")
        self.jobs.append(jobid)
        self._planned[jobid] = {"label": label, "nodes": nodes, "alloc": argv, "steps": []}
        self.stage.on_exit(lambda: self.release(jobid))
        return jobid

    def _wrapper(self, name: str, per_node: list[tuple[list[str], dict[str, str]]],
                 base: str) -> str:
        """The wrapper rendered from its normalized words ({run}, {repo}: quoted as words)."""
        norm = self.door.norm
        return batch.wrapper_script(name, [([norm(str(a)) for a in argv],
                                             {k: norm(str(v)) for k, v in env.items()})
                                            for argv, env in per_node], norm(base))

    def _record_step(self, argv: list[str], label: str, background: bool) -> None:
        """The step's script into scripts/, shellchecked (a gate), its srun line recorded."""
        words = [self.door.norm(str(a)) for a in argv]
        jobid = next(a.split("=", 1)[1] for a in argv if a.startswith("--jobid="))
        command = words[next(i for i, a in enumerate(words) if i and not a.startswith("--")):]
        text = (command[2] if command[:2] == ["bash", "-c"] else
                batch.task_script(label, command))
        self._check_script(label, text, "sh")
        self.door.plan(argv, note=label + (" (left running)" if background else ""))
        self._planned[jobid]["steps"].append((words, background, label))

    def _check_script(self, label: str, text: str, ext: str) -> str:
        """`text` (its paths already {run}/{repo}) into scripts/, then shellcheck: a gate."""
        self._files += 1
        rel = self.stage.write_text(f"scripts/{self._files:02d}-{batch.slug(label)}.{ext}",
                                    text)
        checked = self.door.run([_checker("shellcheck"), "-s", "bash",
                                 str(self.stage.run_dir / rel)],
                                timeout=SHELLCHECK_TIMEOUT_S, check=False)
        self.stage.add(gate(f"{rel.split('/', 1)[1]}: shellcheck clean", checked.rc == 0,
                            f"exit {checked.rc}", "exit 0",
                            checked.stdout.strip()[-600:] or f"{label}: clean", [rel]))
        return rel

    def _run_step(self, argv: list[str], *, timeout: float, label: str) -> CallResult:
        self._record_step(argv, label, background=False)
        raise self._not_run(label)

    def _start_step(self, argv: list[str], *, log_path: Path, label: str) -> Background | None:
        self._record_step(argv, label, background=True)
        return None

    def _wait_ready(self, server: SlurmServer, spec: ServeSpec, add, started: float) -> None:
        raise self._not_run(f"the {spec.engine} serve on {len(server.nodes)} node(s) (its "
                            "readiness, its answers, AIPerf)")

    def release(self, jobid: str) -> bool | None:
        """scancel recorded; the allocation's batch script written and checked."""
        if jobid in self._released:
            return None
        self._released.add(jobid)
        job = self._planned[jobid]
        self.door.plan(batch.cancel_argv(jobid), note=f"cancel the allocation: {job['label']}")
        self._check_script(f"{job['label']} batch", batch.batch_script(
            job["label"], [self.door.norm(a) for a in job["alloc"]], job["steps"], notes=[
                "a plan: {run} and {repo} stand for the run's folder and the guide's checkout "
                "on the file system the nodes share"]), "sbatch")
        return None


def planned_image() -> str:
    """The tag 02 gives the image it builds from these pins (as lib.places.plan says it)."""
    return f"{IMAGE_NAME}:pins-{pins_mod.digest()[:12]}"


def _checker(name: str) -> str:
    """A checker installed beside this interpreter (the guide's venv), by its path."""
    return str(Path(sys.executable).with_name(name))


def node_address(info: dict[str, dict[str, Any]], name: str) -> str:
    """A node's address as scontrol says it (NodeAddr, else NodeHostName, else its name)."""
    first = info.get(name, {})
    return first.get("node_addr") or first.get("node_hostname") or name


def _this_host(addr: str) -> bool:
    """Whether node 0's address is this machine's loopback (the one-host test cluster)."""
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False
