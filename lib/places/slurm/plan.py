"""The slurm place in the door's plan mode (context plan, lib.places.planning): the same
SlurmPlace, serving through the same lib.places.slurm.serve, whose effects, while its door plans,
are these records: every sbatch, srun and scancel recorded (`door.plan`), every step's script
and each allocation's batch script written into the stage's `scripts/` and checked by
shellcheck (a gate each); where it would wait, it stops with its one SKIP reason.

What a plan cannot know is a placeholder, said once in the transcript (`# ...`): the job ids
(`<job-N>`), the nodes (`node-0`, ... as their names and addresses), the image when neither
`image` nor `venv` is given (02's tag for these pins), and, in the written scripts, the run's
folder and the checkout (`{run}`, `{repo}`: on the shared file system).
"""
from __future__ import annotations

import sys
from typing import Any

from lib.core.evidence import gate
from lib.engines import catalog
import lib.places.slurm.sbatch as sbatch  # the module itself, not lib.places (no cycle through it)
from lib.places.planning import Planning, planned_image, tool

SHELLCHECK_TIMEOUT_S = 120.0


class SlurmPlanned(Planning):
    """What a SlurmPlace does where it would act on a cluster, while its door plans (the
    place's `planned`): nothing submitted, nothing waited for; the first wait (an allocation's
    step to end, a server to be ready, the nodes' probe) raises Unsupported with the plan's one
    reason (lib.places.planning.Planning)."""

    def __init__(self, place):
        super().__init__(place.door, target="slurm", verb="submits", past="submitted",
                         kept="the scripts are in scripts/, shellchecked, and the "
                              "sbatch/srun/scancel lines in the transcript")
        self.place, self.stage = place, place.stage
        self.jobs: dict[str, dict[str, Any]] = {}  # job id -> its label, sbatch, steps
        self._files = 0

    # ---- what a plan cannot know ----------------------------------------------------------
    def image(self, given: str) -> str:
        if not given and not self.place.spec.venv:
            given = planned_image(self.stage)
            self.note(f"image: {given} (02's tag for these pins; give -p image "
                      "<registry>/<name>@sha256:... or -p venv /shared/path/.venv)")
        return given

    def nodes_of(self, jobid: str) -> tuple[list[str], dict[str, dict[str, Any]]]:
        names = [f"node-{k}" for k in range(int(self.jobs[jobid]["nodes"]))]
        self.note("nodes: node-0, node-1, ... stand for the nodes Slurm allocates, in node-rank "
                  "order (scontrol show hostnames names them; their NodeAddr is node 0's "
                  "address)")
        return names, {n: {"node_addr": n} for n in names}

    def host_facts(self, probe_timeout_s: float) -> list[dict[str, Any]]:
        place = self.place
        nodes, gpus = int(place.spec.nodes), place.gpus()
        jobid = place._allocate("node probe", nodes, gpus)
        try:
            names, _ = place._nodes_of(jobid)
            place._run_step(place._probe_argv(jobid, len(names),
                                              str(self.stage.path(f"probe-{jobid}")), gpus),
                            timeout=probe_timeout_s, label="the node probe")
        finally:
            place.release(jobid)
        raise self.not_run("the node probe")  # pragma: no cover (_run_step raised)

    def model(self, engine: str) -> None:
        """The seeded model is built where the guide runs: recorded, then the plan stops
        (an engine that serves the pinned model goes on as the place does)."""
        if engine in self.place.engines and not catalog.engine(engine).expert_parallel:
            self.place._python()
            self.door.plan([sys.executable, "-m", "lib.engines.models", "build", "--seed",
                            str(self.place.spec.seed), "--layers",
                            str(self.place.spec.model_layers)],
                           note="the seeded model, built where the guide runs, into the "
                                "checkout's .cache/ on the shared file system")
            raise self.not_run("building the seeded model")

    # ---- effects turned into records ------------------------------------------------------
    def allocate(self, argv: list[str], label: str, nodes: int) -> str:
        jobid = f"<job-{len(self.place.jobs) + 1}>"
        self.note("<job-N>: the job id sbatch --parsable prints for the N-th allocation")
        self.door.plan(argv, note=f"allocate {nodes} node(s): {label}")
        self.jobs[jobid] = {"label": label, "nodes": nodes, "alloc": argv, "steps": []}
        return jobid

    def wrapper(self, name: str, per_node: list[tuple[list[str], dict[str, str]]],
                base: str) -> str:
        """The wrapper rendered from its normalized words ({run}, {repo}: quoted as words)."""
        norm = self.door.norm
        return sbatch.wrapper_script(name, [([norm(str(a)) for a in argv],
                                             {k: norm(str(v)) for k, v in env.items()})
                                            for argv, env in per_node], norm(base))

    def step(self, argv: list[str], label: str, background: bool) -> None:
        """The step's script into scripts/, shellchecked (a gate), its srun line recorded;
        a step run to its end needs its answer, where the plan stops."""
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
        self.jobs[jobid]["steps"].append((words, background, label))
        if not background:
            raise self.not_run(label)

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

    def release(self, jobid: str) -> None:
        """scancel recorded; the allocation's batch script written and checked."""
        job = self.jobs[jobid]
        self.door.plan(sbatch.cancel_argv(jobid), note=f"cancel the allocation: {job['label']}")
        self._check_script(f"{job['label']} batch", sbatch.batch_script(
            job["label"], [self.door.norm(a) for a in job["alloc"]], job["steps"], notes=[
                "a plan: {run} and {repo} stand for the run's folder and the guide's checkout "
                "on the file system the nodes share"]), "sbatch")
