"""The slurm place planning (the plan place, lib.places.planning): the slurm place's own code
(SlurmPlan is a SlurmPlace, serving through the same lib.places.slurm.serve), its effects
turned into records: every sbatch, srun and scancel recorded (`door.plan`), every step's script
and each allocation's batch script written into the stage's `scripts/` and checked by
shellcheck (a gate each); where it would wait, it stops with its one SKIP reason.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from lib.core.door import Background, CallResult
from lib.core.evidence import gate
from lib.engines import catalog
import lib.places.slurm.sbatch as sbatch  # the module itself, not lib.places (no cycle through it)
from lib.places.base import ServeSpec
from lib.places.planning import Planning, planned_image, tool
from lib.places.slurm.place import PROBE_TIMEOUT_S, SlurmPlace
from lib.places.slurm.serve import SlurmServer

SHELLCHECK_TIMEOUT_S = 120.0


class SlurmPlan(SlurmPlace):
    """The slurm place's own code, planning: every sbatch, srun and scancel recorded
    (`door.plan`), every step's script and each allocation's batch script written into the
    stage's `scripts/` and checked by shellcheck (a gate each); nothing submitted, nothing
    waited for: the first wait (an allocation's step to end, a server to be ready, the nodes'
    probe) raises Unsupported with the plan's one reason.

    What a plan cannot know is a placeholder, said once in the transcript (`# ...`): the job
    ids (`<job-N>`), the nodes (`node-0`, ... as their names and addresses), the image when
    neither `image` nor `venv` is given (02's tag for these pins), and, in the written scripts,
    the run's folder and the checkout (`{run}`, `{repo}`: on the shared file system). What it
    says as it plans is its `planning` (lib.places.planning.Planning)."""
    kind = "plan"
    plans_only = True

    def __init__(self, stage, spec=None):
        super().__init__(stage, spec)
        self.planning = Planning(
            self.door, target="slurm", verb="submits", past="submitted",
            kept="the scripts are in scripts/, shellchecked, and the sbatch/srun/scancel lines "
                 "in the transcript")
        self.what = self.planning.what
        self._planned: dict[str, dict[str, Any]] = {}  # job id -> its label, sbatch, steps
        self._files = 0

    # ---- what a plan cannot know ----------------------------------------------------------
    def _image(self) -> str:
        image = super()._image()
        if not image and not self.spec.venv:
            image = planned_image(self.stage)
            self.planning.note(f"image: {image} (02's tag for these pins; give -p image "
                               "<registry>/<name>@sha256:... or -p venv /shared/path/.venv)")
        return image

    def gpus(self) -> int:
        return int(self.spec.gpus_per_node or 0)

    def _nodes_of(self, jobid: str) -> tuple[list[str], dict[str, dict[str, Any]]]:
        nodes = int(self._planned[jobid]["nodes"])
        names = [f"node-{k}" for k in range(nodes)]
        self.planning.note(
            "nodes: node-0, node-1, ... stand for the nodes Slurm allocates, in node-rank "
            "order (scontrol show hostnames names them; their NodeAddr is node 0's "
            "address)")
        return names, {n: {"node_addr": n} for n in names}

    def host_facts(self) -> list[dict[str, Any]]:
        nodes, gpus = int(self.spec.nodes), self.gpus()
        jobid = self._allocate("node probe", nodes, gpus)
        try:
            names, _ = self._nodes_of(jobid)
            self._run_step(self._probe_argv(jobid, len(names),
                                            str(self.stage.path(f"probe-{jobid}")), gpus),
                           timeout=PROBE_TIMEOUT_S, label="the node probe")
        finally:
            self.release(jobid)
        raise self.planning.not_run("the node probe")  # pragma: no cover (_run_step raised)

    def model(self, engine: str, announce: bool = False):
        if engine in self.engines and not catalog.engine(engine).expert_parallel:
            self._python()
            self.door.plan([sys.executable, "-m", "lib.engines.models", "build", "--seed",
                            str(self.spec.seed), "--layers", str(self.spec.model_layers)],
                           note="the seeded model, built where the guide runs, into the "
                                "checkout's .cache/ on the shared file system")
            raise self.planning.not_run("building the seeded model")
        return super().model(engine, announce)

    # ---- effects turned into records ------------------------------------------------------
    def _allocate(self, label: str, nodes: int, gpus: int) -> str:
        argv = self._alloc_argv(label, nodes, gpus)
        jobid = f"<job-{len(self.jobs) + 1}>"
        self.planning.note("<job-N>: the job id sbatch --parsable prints for the N-th allocation")
        self.door.plan(argv, note=f"allocate {nodes} node(s): {label}")
        self.jobs.append(jobid)
        self._planned[jobid] = {"label": label, "nodes": nodes, "alloc": argv, "steps": []}
        self.stage.on_exit(lambda: self.release(jobid))
        return jobid

    def _wrapper(self, name: str, per_node: list[tuple[list[str], dict[str, str]]],
                 base: str) -> str:
        """The wrapper rendered from its normalized words ({run}, {repo}: quoted as words)."""
        norm = self.door.norm
        return sbatch.wrapper_script(name, [([norm(str(a)) for a in argv],
                                             {k: norm(str(v)) for k, v in env.items()})
                                            for argv, env in per_node], norm(base))

    def _record_step(self, argv: list[str], label: str, background: bool) -> None:
        """The step's script into scripts/, shellchecked (a gate), its srun line recorded."""
        words = [self.door.norm(str(a)) for a in argv]
        jobid = next(a.split("=", 1)[1] for a in argv if a.startswith("--jobid="))
        command = words[next(i for i, a in enumerate(words) if i and not a.startswith("--")):]
        per_node = next((a.split("=", 1)[1] for a in argv
                         if a.startswith("--ntasks-per-node=")), "1")
        tasks = (f"every task of one MPI world ({per_node} per node)" if "--label" in argv
                 else "one task on one node")  # sbatch.world_argv labels its tasks
        text = (command[2] if command[:2] == ["bash", "-c"] else
                sbatch.task_script(label, command, tasks))
        self._check_script(label, text, "sh")
        self.door.plan(argv, note=label + (" (left running)" if background else ""))
        self._planned[jobid]["steps"].append((words, background, label))

    def _check_script(self, label: str, text: str, ext: str) -> str:
        """`text` (its paths already {run}/{repo}) into scripts/, then shellcheck: a gate."""
        self._files += 1
        rel = self.stage.write_text(f"scripts/{self._files:02d}-{sbatch.slug(label)}.{ext}",
                                    text)
        checked = self.door.run([tool("shellcheck"), "-s", "bash",
                                 str(self.stage.run_dir / rel)],
                                timeout=SHELLCHECK_TIMEOUT_S, check=False)
        self.stage.add(gate(f"{rel.split('/', 1)[1]}: shellcheck clean", checked.rc == 0,
                            f"exit {checked.rc}", "exit 0",
                            checked.stdout.strip()[-600:] or f"{label}: clean", [rel]))
        return rel

    def _run_step(self, argv: list[str], *, timeout: float, label: str) -> CallResult:
        self._record_step(argv, label, background=False)
        raise self.planning.not_run(label)

    def _start_step(self, argv: list[str], *, log_path: Path, label: str) -> Background | None:
        self._record_step(argv, label, background=True)
        return None

    def _wait_ready(self, server: SlurmServer, spec: ServeSpec, add, started: float) -> None:
        raise self.planning.not_run(f"the {spec.engine} serve on {len(server.nodes)} node(s) (its "
                                    "readiness, its answers, AIPerf)")

    def release(self, jobid: str) -> bool | None:
        """scancel recorded; the allocation's batch script written and checked."""
        if jobid in self._released:
            return None
        self._released.add(jobid)
        job = self._planned[jobid]
        self.door.plan(sbatch.cancel_argv(jobid), note=f"cancel the allocation: {job['label']}")
        self._check_script(f"{job['label']} batch", sbatch.batch_script(
            job["label"], [self.door.norm(a) for a in job["alloc"]], job["steps"], notes=[
                "a plan: {run} and {repo} stand for the run's folder and the guide's checkout "
                "on the file system the nodes share"]), "sbatch")
        return None
