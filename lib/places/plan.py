"""The plan place: what a cluster place would run, recorded, with nothing run against a cluster
or a server.

A plan stage opens its door in plan mode (lib.core.door): every command the planned place would
run is recorded as a planned call (`door.plan`), never executed; only local checkers run
(kubernetes-validate, shellcheck: lib.core.door.PLAN_CHECKERS). `plan_for` names the place planned
for (kube by default, or slurm): its renderers make the objects and scripts, this place records
them into the stage folder and lists the commands in order, then says what was not run in one
SKIP reason per capability.
"""
from __future__ import annotations

from typing import Any

from lib.places.base import NodeRank, Place, RankJob, ServeSpec, Unsupported

PLANNED_RDZV_PORT = 29500  # the rendezvous a planned multi-node job uses (no local port is taken)


class PlanPlace(Place):
    kind = "plan"

    def __init__(self, stage):
        super().__init__(stage)
        self.target = stage["plan_for"] if "plan_for" in stage.params else "kube"
        self.what = f"a plan for the {self.target} place (nothing is run against a cluster)"
        self.commands: list[list[str]] = []

    def _planned(self, argv: list[str], note: str) -> None:
        self.door.plan(argv, note=note)
        self.commands.append(argv)

    def _not_run(self, what: str) -> Unsupported:
        return Unsupported(f"plan for {self.target}: {what} is planned, not run (context plan "
                           "executes nothing against a cluster or a server)")

    def gpus(self) -> int:
        return int(self.stage["gpus_per_node"] or 0)

    def host_facts(self) -> list[dict[str, Any]]:
        raise self._not_run("the node probe")

    def run_ranks(self, job: RankJob) -> list:
        """Each node's command line, as the planned place would start it: recorded, not run."""
        for rank in range(job.nodes):
            node = NodeRank(rank, job.nodes, "<node-0>", PLANNED_RDZV_PORT)
            env = job.env(node)
            self._planned([f"{k}={v}" for k, v in sorted(env.items())] + job.argv(node),
                          note=f"{job.name}: node {rank} of {job.nodes}")
        raise self._not_run(f"{job.name} on {job.nodes} node(s)")

    def model(self, engine: str, announce: bool = False):
        raise self._not_run(f"serving {self.stage['model'] or 'the model'}")

    def serve(self, spec: ServeSpec):
        raise self._not_run("the serve")

    def build_image(self, *, dockerfile, context, tag: str, repo) -> dict:
        self._planned(["docker", "build", "--progress=plain", "-f", str(dockerfile), "-t", tag,
                       str(context)], note="the image, built where a Docker engine is")
        raise self._not_run("the image build and its verify-image.sh")

    def run_job(self, argv: list[str], *, env: dict[str, str], timeout_s: float):
        self._planned(argv, note="a job beside the server")
        raise self._not_run("the job")
