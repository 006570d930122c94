"""The plan place: what a cluster place would run, rendered, checked and recorded, with nothing
run against a cluster or a server.

`plan_for` names the place planned for (kube by default, or slurm). The plan IS that place's
code with its effects turned into records: the same renderers make the same objects and
commands, but where the place would apply or submit, the plan writes the objects into the
stage's `manifests/` folder, runs the local checkers on them (`kubernetes-validate --strict` at
the Kubernetes version EKS runs, shellcheck on every embedded script; gates), and records the
command in the transcript (`door.plan`, the door's plan mode refusing anything else). Where the
place would then wait for pods or read logs, the plan stops and says so in one SKIP reason.

Values a plan cannot know are placeholders, said in its notes: the image (the tag 02 gives the
build of these pins) and, when not given, the model cache directory and the nodes' names.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from lib.core.evidence import gate
import lib.places.manifests as manifests  # the renderers themselves, not lib.places (no cycle through it)
from lib.places.base import NodeRank, Place, RankJob, ServeSpec, Unsupported
from lib.places.kube import KubePlace
from lib.roots import pins as pins_mod

PLANNED_RDZV_PORT = 29500  # the rendezvous a planned multi-node job uses (no local port is taken)
PLACEHOLDER_CACHE = "/mnt/instance-store/hf-cache"  # said in the plan: set model_cache_dir
IMAGE_NAME = "deepep-v2-efa"  # as 02 tags its build (lib.stages.image)


def planned_image() -> str:
    """The tag 02 gives the image it builds from these pins (pins-<digest>)."""
    return f"{IMAGE_NAME}:pins-{pins_mod.digest()[:12]}"


class PlanPlace(Place):
    """A plan for a place this module has no renderer for yet (slurm until its renderer lands):
    each node's command line recorded, nothing run."""
    kind = "plan"

    def __init__(self, stage, target: str = "slurm"):
        super().__init__(stage)
        self.target = target
        self.what = f"a plan for the {target} place (nothing is run against a cluster)"
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


class KubePlan(KubePlace):
    """The kube place's own code, planning: objects rendered into manifests/, checked, and the
    kubectl commands recorded; nothing applied, nothing waited for."""
    kind = "plan"
    target = "kube"
    applies = False

    def __init__(self, stage):
        super().__init__(stage)
        self.what = "a plan for the kube place (nothing is applied to a cluster)"
        self.notes: list[str] = []

    def _not_run(self, what: str) -> Unsupported:
        return Unsupported(f"plan for kube: {what} is planned, not run (context plan applies "
                           "nothing to a cluster); the objects are in manifests/, checked, and "
                           "the kubectl commands in the transcript")

    # ---- what a plan cannot know ----------------------------------------------------------
    def _image(self) -> str:
        image = self.stage.params.get("image") or ""
        if not image:
            image = planned_image()
            self._note(f"image: {image} (02's tag for these pins; give -p image "
                       "<registry>/<name>@sha256:... to plan the image you pushed)")
        return image

    def nodes(self) -> list[dict]:
        if self._nodes is None:
            self._nodes = [{"metadata": {"name": f"node-{k}", "labels": {
                manifests.INSTANCE_TYPE_LABEL: self.stage["instance_type"]}},
                "status": {"allocatable": {manifests.GPU_RESOURCE: str(self.stage[
                    "gpus_per_node"]), manifests.EFA_RESOURCE: str(self.stage["efa_per_node"])},
                    "conditions": [{"type": "Ready", "status": "True"}]}}
                for k in range(self.stage["nodes"])]
            self._note(f"nodes: node-0..node-{self.stage['nodes'] - 1} stand for the cluster's "
                       f"{self.stage['instance_type']} nodes (kubectl get nodes names them)")
        return self._nodes

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            self.door.plan(["#", text], note="a placeholder of the plan")

    def _run(self, *args: str, timeout: float = 120.0):
        if args and args[0] in ("delete",):
            self.door.plan(self.kubectl(*args), note="clean-up")
            return None
        if args[:1] == ("version",):
            raise self._not_run("the cluster's version")
        raise self._not_run(f"kubectl {args[0]}")

    def host_facts(self) -> list[dict[str, Any]]:
        facts = [{"node": n["metadata"]["name"]} for n in self.nodes()]
        objects = [manifests.node_probe_pod(run_id=self.stage.run_id, node=f["node"],
                                            image=self._image(), namespace=self.namespace,
                                            stage=self.stage.name) for f in facts]
        self.apply(objects, "node-probes")
        raise self._not_run(f"the node probe ({len(objects)} pods)")

    # ---- effects turned into records ------------------------------------------------------
    def apply(self, objects: list[dict], name: str) -> str:
        rel = self.stage.write_text(f"manifests/{name}.yaml", manifests.to_yaml(objects))
        path = self.stage.run_dir / rel
        validate = manifests.validate_argv([str(path)])
        checked = self.door.run([tool(validate[0]), *validate[1:]], timeout=300, check=False)
        self.stage.add(gate(f"{name}: manifests valid (kubernetes-validate --strict "
                            f"{manifests.KUBE_VERSION})", checked.rc == 0,
                            f"exit {checked.rc}", "exit 0",
                            (checked.stdout + checked.stderr).strip()[-600:]
                            or "every object valid", [rel]))
        scripts = manifests.embedded_scripts(objects)
        for k, script in enumerate(scripts):
            # the script as the container runs it (`bash -c` / `sh -c`), with its shell named
            rel_script = self.stage.write_text(
                f"manifests/{name}.script-{k}.sh",
                f"#!/usr/bin/env {script['shell']}\n{script['script']}")
            shell = self.door.run([tool("shellcheck"), "-s", script["shell"],
                                   str(self.stage.run_dir / rel_script)], timeout=120,
                                  check=False)
            self.stage.add(gate(f"{name}: shellcheck clean on {script.get('where', 'a script')}",
                                shell.rc == 0, f"exit {shell.rc}", "exit 0",
                                shell.stdout.strip()[-600:] or "clean", [rel_script]))
        self.door.plan(self.kubectl("apply", "-f", rel), note=f"apply {name}")
        return rel

    def wait_pods(self, names: list[str], *, done: bool, timeout_s: float) -> dict[str, dict]:
        what = "finished" if done else "ready"
        self.door.plan(self.kubectl("wait", "--for", "condition=" + (
            "Ready" if not done else "complete"), "--timeout", f"{int(timeout_s)}s",
            *[f"pod/{n}" for n in names]), note=f"wait until {what}")
        raise self._not_run(f"{', '.join(names)} ({what})")

    def serve(self, spec: ServeSpec):
        if not self.stage.params.get("model_cache_dir"):
            self.stage.params["model_cache_dir"] = PLACEHOLDER_CACHE
            self._note(f"model_cache_dir: {PLACEHOLDER_CACHE} (where your nodes mount their "
                       "NVMe instance storage: give -p model_cache_dir)")
        return super().serve(spec)

    def clean_up(self) -> None:
        """A plan applied nothing: there is nothing to delete."""


def tool(name: str) -> str:
    """A checker installed beside this interpreter (the guide's venv), by its path: a notebook
    kernel's PATH need not hold the venv's bin/ (the door records it as {bin}/)."""
    return str(Path(sys.executable).with_name(name))


def plan_place(stage) -> Place:
    """The plan of the place `plan_for` names."""
    target = stage.params.get("plan_for") or "kube"
    if target == "kube":
        return KubePlan(stage)
    from lib.places.slurm import SlurmPlan  # the slurm place's own code, planning

    return SlurmPlan(stage)
