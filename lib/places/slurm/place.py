"""The slurm place: a Slurm cluster through sbatch, srun, squeue, scontrol and scancel, each
call through the door (`partition`, `account`, `time_limit_min`, `schedule_timeout_s`,
`job_timeout_s`; the software from `image` through pyxis, or from `venv`).

What it runs (the argv and scripts: lib.places.slurm.sbatch; what comes back is read by
lib.places.slurm.parse; the waits on squeue and scontrol are lib.places.slurm.waits):

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
  (lib.places.slurm.sbatch.PROBE_SCRIPT, on the nodes themselves: the kernel's, /proc's and
  /sys's facts are the host's) and `scontrol -o show node <nodelist>` for the allocated nodes;
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

Serving (`model`, `serve`; stages 04, 05 and 06) is the SlurmServing this place holds
(`serving`, lib.places.slurm.serve), AIPerf as a step lib.places.slurm.aiperf's. While its door
plans (context plan), this place's effects are records instead (`planned`,
lib.places.slurm.plan.SlurmPlanned): the same code.
"""
from __future__ import annotations

import sys
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from lib.core.door import REPO_ROOT, Background, CallResult
from lib.core.errors import NotAllocated, PlaceError, Unsupported
from lib.core.evidence import gate
import lib.places.slurm.sbatch as sbatch  # the module itself, not lib.places (no cycle through it)
from lib.places.slurm import parse
from lib.places.base import NodeNeeds, NodeRank, NodeRun, Place, RankJob, ServeSpec
from lib.places.cluster import DEEPEP_IN_IMAGE, ranks_apart_gate
from lib.places.instances import INSTANCE_TYPES
from lib.places.slurm import aiperf, waits
from lib.places.slurm.plan import SlurmPlanned
from lib.places.slurm.serve import SlurmServer, SlurmServing, node_address, this_host

PROBE_TIMEOUT_S = 300.0  # the node probe step
# job states in which Slurm, not the ranks, ended the job (squeue(1)'s JOB STATE CODES)
SLURM_ENDED = ("BOOT_FAIL", "DEADLINE", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "REQUEUED",
               "REQUEUE_FED", "REQUEUE_HOLD", "TIMEOUT")
NODE_OUT = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING")  # scontrol's node states out of service


class SlurmPlace(Place):
    """The slurm place (see the module's docstring). Its allocations and steps are its own
    methods, which while its door plans (context plan) are records instead (`planned`:
    lib.places.slurm.plan.SlurmPlanned); its serving is the SlurmServing it holds (`serving`,
    lib.places.slurm.serve), which runs in them; AIPerf's step is lib.places.slurm.aiperf's; the waits that poll Slurm are
    lib.places.slurm.waits'."""
    kind = "slurm"
    what = "the slurm place (Slurm through sbatch/srun)"
    engines = ("transformers", "vllm", "sglang", "trtllm")
    gin = True  # p5en nodes: EFA, DeepEP's GIN on
    # the nodes' GPU processes get the stage's transport contract (Place.transport: EFA)
    shares_files = True  # the run's folder is on the nodes' shared file system (see above)

    def __init__(self, stage, spec=None):
        super().__init__(stage, spec)
        self._rows: list[dict[str, Any]] | None = None
        self._released: set[str] = set()
        self.serving = SlurmServing(self)  # the serves' allocation and steps (serve.py)
        self.jobs: list[str] = []  # every job id this place submitted, in order
        self.last_facts: list[dict[str, Any]] | None = None  # host_facts()' answer, every node
        # the door's plan mode: what this place would submit, recorded and checked
        self.planned = SlurmPlanned(self) if self.door.planning else None
        if self.planned:
            self.what = self.planned.what

    # ---- what the stage handed it (lib.places.base.PlaceSpec) --------------------------------
    def _image(self) -> str:
        """`image` as given ('' for none); a plan stands a placeholder in for it."""
        if self.planned:
            return self.planned.image(self.spec.image or "")
        return self.spec.image or ""

    def _venv(self) -> str | None:
        """`venv` as a path: as given when absolute, else inside the checkout (which the nodes
        share): a recorded run then names it relative to the repository and replays in any
        checkout."""
        venv = self.spec.venv
        if not venv or self._image():
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
        if self._image():
            return DEEPEP_IN_IMAGE
        return self.spec.deepep_dir or None

    def nccl_site(self) -> str | None:
        """The NCCL to preload: none in the image (it pins its own), else `nccl_site`."""
        return None if self._image() else (self.spec.nccl_site or None)

    def _python(self) -> str:
        """The interpreter the nodes run; Unsupported when neither an image nor a venv says
        (once the cluster answered: PlaceError when it does not)."""
        if self._image() or self.spec.venv:
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

    def _in_image(self) -> dict[str, Any]:
        """A step's image and mounts (the run's folder and the checkout at the same paths)."""
        image = self._image()
        return {"image": image,
                "mounts": (str(self.stage.run_dir), str(REPO_ROOT)) if image else ()}

    # ---- the cluster's nodes ------------------------------------------------------------------
    def where(self) -> str:
        """The cluster this place drives, as a refusal names it."""
        partition = self.spec.partition
        return f"slurm partition {partition!r}" if partition else "slurm's default partition"

    def _query(self, argv: list[str]) -> CallResult:
        call = self.door.run(argv, timeout=waits.QUERY_TIMEOUT_S, check=False)
        if call.rc == 127:
            raise PlaceError(self.where(), "Slurm's clients (sinfo, sbatch, srun, squeue, "
                             "scontrol, scancel) are not on this machine", call)
        if not call.ok:
            raise PlaceError(self.where(), f"{argv[0]} did not answer", call)
        return call

    def nodes(self) -> list[dict[str, Any]]:
        """The partition's nodes (`partition`, else the default partition), from sinfo."""
        if self._rows is None:
            partition = self.spec.partition
            rows = parse.parse_sinfo(self._query(sbatch.sinfo_argv(partition)).stdout)
            if not partition and any(r["default"] for r in rows):
                rows = [r for r in rows if r["default"]]
            if not rows:
                raise PlaceError(self.where(), "sinfo lists no node in it")
            self._rows = rows
        return self._rows

    def gpus(self) -> int:
        """GPUs per node: the fewest the partition's nodes declare as GRES (0 without GRES; a
        plan: gpus_per_node)."""
        if self.planned:
            return int(self.spec.gpus_per_node or 0)
        return min(r["gres_gpus"] for r in self.nodes())

    def node_needs(self) -> NodeNeeds:
        """A Slurm cluster of p5en nodes: GPUs and EFA devices as the instance type has them,
        gdrdrv >= 2.5 and hugepages, all required. A run that declares nodes without EFA
        (`efa_per_node` 0, e.g. CPU nodes) has no EFA path: gdrdrv and hugepages are then not
        required (a SKIP each, saying so); the GPU and EFA counts are gated as declared."""
        gpus, efa = self.spec.gpus_per_node, self.spec.efa_per_node
        kind = self.spec.instance_type
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
        if self.planned:
            return self.planned.host_facts(PROBE_TIMEOUT_S)
        version = self._query(["sinfo", "--version"]).stdout.strip()
        rows = {r["node"]: r for r in self.nodes()}
        gpus, nodes = self.gpus(), int(self.spec.nodes)
        self._require_usable_nodes(rows, nodes)
        try:
            jobid = self._allocate("node probe", nodes, gpus)
        except NotAllocated as why:
            raise PlaceError(self.where(), f"the node probe was not allocated: {why}") from None
        try:
            names, info = self._nodes_of(jobid)
            base = self.stage.path(f"probe-{jobid}")
            call = self._run_step(self._probe_argv(jobid, len(names), str(base), gpus),
                                  timeout=min(PROBE_TIMEOUT_S, self.spec.job_timeout_s),
                                  label="the node probe")
        except NotAllocated as why:
            raise PlaceError(self.where(), f"the node probe was not allocated: {why}") from None
        finally:
            self.release(jobid)
        report, facts = parse.srun_report(call.stderr), []
        access = (f"{version}: sbatch, srun, squeue, scontrol, scancel answered; partition "
                  f"{rows[names[0]]['partition'] if names[0] in rows else '?'}")
        for rank, name in enumerate(names):
            out = self.stage.rel(Path(f"{base}-node{rank}.out"))
            probed = parse.parse_probe(self.door.read_text(f"{base}-node{rank}.out"))
            slurm = {**rows.get(name, {}), **info.get(name, {})}
            slurm.pop("default", None)
            facts.append({
                "node": name, **slurm, **probed,
                "instance_type": next((f for f in slurm.get("features", [])
                                       if f in INSTANCE_TYPES), None),
                "ready": probed["probe_complete"] and parse.usable(slurm.get("slurm_state")),
                "cluster_access": access,
                "probe_rc": None if call.timed_out else report.get(rank, 0 if call.ok else None),
                "evidence": [out],
            })
        self.last_facts = facts
        return facts

    def _require_usable_nodes(self, rows: dict[str, dict[str, Any]], asked: int) -> None:
        """Before any allocation: fewer nodes of the partition in a state that runs jobs than
        the run asks FAILs 00 at once, each other node named with its state and the reason
        Slurm holds for it (`scontrol show node`: an administrator's drain reason, "Not
        responding"), rather than a probe that pends until Slurm's pending reason says so."""
        usable = [n for n, r in rows.items() if parse.usable(r["slurm_state"])]
        if len(usable) >= asked:
            return
        if len(rows) < asked:  # Slurm would queue it for good (PartitionNodeLimit)
            raise PlaceError(self.where(), f"it has {len(rows)} node(s) ({', '.join(rows)}), "
                             f"the run asks {asked} (nodes)")
        said = []
        for name, row in rows.items():
            if name in usable:
                continue
            shown = self.door.run(["scontrol", "-o", "show", "node", name],
                                  timeout=waits.QUERY_TIMEOUT_S, check=False)
            raw = parse.parse_scontrol(shown.stdout) if shown.ok else {}
            reason = raw.get("Reason")
            said.append(f"{name} is {row['slurm_state']} (sinfo)"
                        + (f", reason {reason!r} (scontrol show node)" if reason else ""))
        raise PlaceError(self.where(), f"{len(usable)} of its {len(rows)} node(s) in a state "
                         f"that runs jobs, the run asks {asked}: " + "; ".join(said))

    def _probe_argv(self, jobid: str, nodes: int, base: str, gpus: int) -> list[str]:
        """The probe step: bash on the nodes themselves (never in the image)."""
        return sbatch.step_argv(
            jobid=jobid, nodes=nodes, out_base=base,
            time_min=self.spec.time_limit_min, script=sbatch.probe_script(),
            script_name="guide-node-probe", chdir=str(self.stage.dir),
            gpus_per_node=gpus, kill_on_bad_exit=False)

    # ---- ranks --------------------------------------------------------------------------------
    def run_ranks(self, job: RankJob) -> list[NodeRun]:
        """One allocation of job.nodes nodes, one step, node N running job.argv/env of rank N;
        every node's exit code and whole output (from its --output/--error files)."""
        python = self._python()
        gpus = self.gpus()
        timeout = min(float(job.timeout_s), float(self.spec.job_timeout_s))
        try:
            jobid = self._allocate(job.name, job.nodes, gpus)
        except NotAllocated as why:
            return self._never_ran(job, str(why), why.timed_out)
        try:
            names, info = self._nodes_of(jobid)
            if job.nodes > 1 and not self.plans_only:  # rank N on node N, a task each
                self.stage.add(ranks_apart_gate(
                    job.name, {r: names[r] if r < len(names) else None
                               for r in range(job.nodes)}, None, [],
                    " (the allocation's nodes, a task each: Slurm starts a step's tasks "
                    "together)"))
            addr = node_address(info, names[0])
            port = self.door.free_port() if this_host(addr) else sbatch.RDZV_PORT
            per_node = []
            for rank in range(job.nodes):
                node = NodeRank(rank, job.nodes, addr, port)
                argv = [str(a) for a in job.argv(node)]
                if argv and argv[0] == sys.executable:  # this machine's interpreter: the nodes'
                    argv[0] = python
                per_node.append((argv, job.env(node)))
            base = str(self.stage.path(f"{sbatch.slug(job.name)}-{jobid}"))
            cpus = [info[n]["slurm_cpus"] for n in names if info.get(n, {}).get("slurm_cpus")]
            call = self._run_step(sbatch.step_argv(
                jobid=jobid, nodes=job.nodes, out_base=base,
                time_min=self.spec.time_limit_min,
                script=self._wrapper(job.name, per_node, base),
                script_name=f"guide-{sbatch.slug(job.name)}", chdir=str(job.cwd or REPO_ROOT),
                cpus_per_task=min(cpus) if cpus else None, gpus_per_node=gpus,
                **self._in_image()), timeout=timeout, label=f"{job.name} on {job.nodes} node(s)")
            # Slurm's account, read before the guide's scancel makes every job CANCELLED
            fate = None if call.ok or call.timed_out else waits.job_fate(self.door, jobid, names)
        except NotAllocated as why:
            return self._never_ran(job, str(why), why.timed_out)
        finally:
            self.release(jobid)
        runs = self._node_runs(job, base, call)
        if fate is not None:
            self._add_fate_gate(job.name, jobid, fate, runs, call.stderr)
        return runs

    def _node_runs(self, job: RankJob, base: str, call: CallResult) -> list[NodeRun]:
        """Each node's files, read once the job has ended: its rc from the wrapper's .rc file,
        else from srun's own report (a task killed before it could write it)."""
        report = parse.srun_report(call.stderr)
        srun_stream = f"calls/{self.stage.name}/{call.seq:04d}.stderr"
        runs = []
        for rank in range(job.nodes):
            out = self.door.read_text(f"{base}-node{rank}.out")
            err = self.door.read_text(f"{base}-node{rank}.err")
            rc = parse.parse_rc(self.door.read_text(f"{base}-node{rank}.rc"))
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

    def _add_fate_gate(self, label: str, jobid: str, fate: dict[str, Any], runs: list[NodeRun],
                       srun_stderr: str) -> None:
        """The FAIL naming the step, the node and the reason as Slurm says them, when Slurm
        ended the step (slurmstepd's CANCELLED ... DUE TO line, a node DOWN or DRAINED, a job
        requeued or ended by its time limit); nothing when the ranks failed by themselves (the
        first-failure triage names those)."""
        ended = list({(e["id"], e["node"], e["due"]): e for e in parse.parse_ended(
            "\n".join([srun_stderr, *(r.stderr for r in runs)]))}.values())
        job, nodes = fate["job"], fate["nodes"]
        bad = {n: v for n, v in nodes.items() if any(w in v["state"] for w in NODE_OUT)}
        state, restarts = job.get("JobState", "gone"), job.get("Restarts", "0")
        if not (any(e["due"] for e in ended) or bad or state in SLURM_ENDED
                or restarts not in ("", "0")):
            return
        step = next((e for e in ended if e["due"]), ended[0] if ended else None)
        said = [f"{step['what'].lower()} {step['id']} on {step['node']} CANCELLED"
                f"{' DUE TO ' + step['due'] if step['due'] else ''} (slurmstepd)" if step
                else "no slurmstepd line"]
        said += [f"node {n} {v['state']}, reason {v['reason'] or 'none given'!r}"
                 for n, v in bad.items()] or [f"its nodes {', '.join(nodes) or '?'} up"]
        said.append(f"job {jobid} {state} (reason {job.get('Reason', '?')}, time limit "
                    f"{job.get('TimeLimit', '?')} = time_limit_min "
                    f"{self.spec.time_limit_min}"
                    f"{', requeued by Slurm: Restarts=' + restarts if restarts not in ('', '0') else ''}"
                    "), then cancelled by the guide")
        streams = list(dict.fromkeys(s for r in runs for s in r.streams))
        self.stage.add(gate(
            f"{label}: Slurm's account of the step", False,
            {"step": step, "job_state": state, "job_reason": job.get("Reason"),
             "restarts": restarts, "time_limit": job.get("TimeLimit"),
             "time_limit_min": self.spec.time_limit_min, "nodes": nodes,
             "source": "slurmstepd's line; scontrol show job and show node"},
            "the step ends by itself on nodes that stay up", "; ".join(said), streams))

    def _never_ran(self, job: RankJob, reason: str, timed_out: bool) -> list[NodeRun]:
        return [NodeRun(rank, None, "", reason, timed_out, []) for rank in range(job.nodes)]

    # ---- one allocation -----------------------------------------------------------------------
    def _allocate(self, label: str, nodes: int, gpus: int) -> str:
        """Submit the allocation; its job id (cancelled at the latest when the stage ends)."""
        if self.planned:
            jobid = self.planned.allocate(self._alloc_argv(label, nodes, gpus), label, nodes)
            self.jobs.append(jobid)
            self.stage.on_exit(lambda: self.release(jobid))
            return jobid
        call = self.door.run(self._alloc_argv(label, nodes, gpus),
                             timeout=waits.SUBMIT_TIMEOUT_S, check=False)
        jobid = call.stdout.strip().split(";")[0] if call.ok else ""
        if not jobid.isdigit():
            raise NotAllocated(f"sbatch refused the allocation of {nodes} node(s) (rc "
                                f"{call.rc}): {call.stderr.strip() or call.stdout.strip()}")
        self.jobs.append(jobid)
        self.stage.on_exit(lambda: self.release(jobid))
        self.stage.dir.mkdir(parents=True, exist_ok=True)  # where the nodes write their output
        return jobid

    def _alloc_argv(self, label: str, nodes: int, gpus: int) -> list[str]:
        return sbatch.alloc_argv(
            name=f"guide-{self.stage.name}-{sbatch.slug(label)}", nodes=nodes,
            time_min=self.spec.time_limit_min, partition=self.spec.partition,
            account=self.spec.account, gpus_per_node=gpus)

    def _nodes_of(self, jobid: str) -> tuple[list[str], dict[str, dict[str, Any]]]:
        """The allocation's nodes once it runs (NotAllocated when it does not, or is still not
        running after `schedule_timeout_s`)."""
        if self.planned:
            return self.planned.nodes_of(jobid)
        return self._allocated_nodes(waits.wait_running(self.door, jobid,
                                                        float(self.spec.schedule_timeout_s)))

    def _wrapper(self, name: str, per_node: list[tuple[list[str], dict[str, str]]],
                 base: str) -> str:
        if self.planned:
            return self.planned.wrapper(name, per_node, base)
        return sbatch.wrapper_script(name, per_node, base)

    def _run_step(self, argv: list[str], *, timeout: float, label: str) -> CallResult:
        """One step run to its end from this machine (srun waits for its tasks)."""
        if self.planned:
            self.planned.step(argv, label, background=False)  # raises: the plan stops here
        return self.door.run(argv, timeout=timeout, check=False)

    def _start_step(self, argv: list[str], *, log_path: Path, label: str) -> Background | None:
        """One step started and left running (a server's): srun in its own session, its
        output into `log_path`."""
        if self.planned:
            return self.planned.step(argv, label, background=True)
        return self.door.start(argv, log_path=log_path)

    def _allocated_nodes(self, nodelist: str) -> tuple[list[str], dict[str, dict[str, Any]]]:
        """The allocation's node names in node-rank order, and each one's scontrol facts."""
        names = self._query(sbatch.hostnames_argv(nodelist)).stdout.split()
        info = parse.parse_nodes(self._query(sbatch.show_node_argv(nodelist)).stdout)
        if not names:
            raise NotAllocated(f"scontrol show hostnames {nodelist} named no node")
        return names, info

    def release(self, jobid: str) -> bool | None:
        """scancel the job, then wait until squeue no longer shows it (its processes are gone
        once it has left COMPLETING): whether it is gone (None: released before). Once per
        job: the stage's on_exit asks again."""
        if jobid in self._released:
            return None
        self._released.add(jobid)
        if self.planned:
            return self.planned.release(jobid)
        self.door.run(sbatch.cancel_argv(jobid), timeout=waits.SUBMIT_TIMEOUT_S, check=False)
        return waits.wait_gone(self.door, jobid)

    # ---- serving (lib.places.slurm.serve, lib.places.slurm.aiperf) -----------------------------
    def model(self, engine: str, announce: bool = False):
        """The model to serve and the gate of how it was had (SlurmServing.model)."""
        if self.planned:
            self.planned.model(engine)
        return self.serving.model(engine, announce)

    def serve(self, spec: ServeSpec) -> AbstractContextManager[SlurmServer]:
        """The server as steps of an allocation (SlurmServing.serve)."""
        return self.serving.serve(spec)

    def _wait_ready(self, server: SlurmServer, spec: ServeSpec, add, started: float) -> None:
        """Until the server answers, then its logs gated (SlurmServing.wait_ready); a plan
        stops here."""
        if self.planned:
            raise self.planned.not_run(f"the {spec.engine} serve on {len(server.nodes)} node(s) "
                                       "(its readiness, its answers, AIPerf)")
        self.serving.wait_ready(server, spec, add, started)

    def read_model_config(self, server, model: dict[str, Any]):
        """The served model's config.json (SlurmServing.read_model_config)."""
        return self.serving.read_model_config(server, model)

    def aiperf_beside(self, server: SlurmServer, argv_for, *, timeout: float, out: Path,
                      name: str) -> CallResult:
        """One AIPerf cell as a step of the server's allocation (lib.places.slurm.aiperf)."""
        return aiperf.aiperf_beside(self, server, argv_for, timeout=timeout, out=out, name=name)
