"""The kube place planning (the plan place, lib.places.planning): the kube place's own code
(KubePlan is a KubePlace), its effects turned into records. Where it would apply, the objects are written into the stage's
`manifests/` folder and checked (`kubernetes-validate --strict` at the Kubernetes version EKS
runs, shellcheck on every embedded script; gates), and the kubectl command is recorded
(`door.plan`); where it would wait for pods or read logs, it stops with its one SKIP reason.

Values it cannot know are placeholders, said in its notes: the image (the tag 02 gives the
build of these pins), the model cache directory and the nodes' names.
"""
from __future__ import annotations

from typing import Any

from lib.core.evidence import gate
import lib.places.kube.manifests as manifests  # the renderers themselves, not lib.places (no cycle through it)
from lib.places.base import ServeSpec
from lib.places.kube.place import KubePlace
from lib.places.planning import Planning, planned_image, tool

PLACEHOLDER_CACHE = "/mnt/instance-store/hf-cache"  # said in the plan: set model_cache_dir


class KubePlan(KubePlace):
    """The kube place's own code, planning: objects rendered into manifests/, checked, and the
    kubectl commands recorded; nothing applied, nothing waited for. What it says as it plans
    (its placeholders, its one reason) is its `planning` (lib.places.planning.Planning)."""
    kind = "plan"
    plans_only = True

    def __init__(self, stage, spec=None):
        super().__init__(stage, spec)
        self.planning = Planning(
            self.door, target="kube", verb="applies", past="applied",
            kept="the objects are in manifests/, checked, and the kubectl commands in the "
                 "transcript")
        self.what = self.planning.what

    # ---- what a plan cannot know ----------------------------------------------------------
    def _image(self) -> str:
        image = self.spec.image
        if not image:
            image = planned_image(self.stage)
            self.planning.note(f"image: {image} (02's tag for these pins; give -p image "
                               "<registry>/<name>@sha256:... to plan the image you pushed)")
        return image

    def nodes(self) -> list[dict]:
        if self._nodes is None:
            spec = self.spec
            self._nodes = [{"metadata": {"name": f"node-{k}", "labels": {
                manifests.INSTANCE_TYPE_LABEL: spec.instance_type}},
                "status": {"allocatable": {manifests.GPU_RESOURCE: str(spec.gpus_per_node),
                                           manifests.EFA_RESOURCE: str(spec.efa_per_node)},
                    "conditions": [{"type": "Ready", "status": "True"}]}}
                for k in range(spec.nodes)]
            self.planning.note(f"nodes: node-0..node-{spec.nodes - 1} stand for the cluster's "
                               f"{spec.instance_type} nodes (kubectl get nodes names them)")
        return self._nodes

    def _run(self, *args: str, timeout: float = 120.0):
        if args and args[0] in ("delete",):
            self.door.plan(self.kubectl(*args), note="clean-up")
            return None
        if args[:1] == ("version",):
            raise self.planning.not_run("the cluster's version")
        raise self.planning.not_run(f"kubectl {args[0]}")

    def host_facts(self) -> list[dict[str, Any]]:
        facts = [{"node": n["metadata"]["name"]} for n in self.nodes()]
        objects = [manifests.node_probe_pod(run_id=self.stage.run_id, node=f["node"],
                                            image=self._image(), namespace=self.namespace,
                                            stage=self.stage.name) for f in facts]
        self.apply(objects, "node-probes")
        raise self.planning.not_run(f"the node probe ({len(objects)} pods)")

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

    def wait_pods(self, names: list[str], *, done: bool, timeout_s: float,
                  made_by: str | None = None, peers: bool = False) -> dict[str, dict]:
        what = "finished" if done else "ready"
        self.door.plan(self.kubectl("wait", "--for", "condition=" + (
            "Ready" if not done else "complete"), "--timeout", f"{int(timeout_s)}s",
            *[f"pod/{n}" for n in names]), note=f"wait until {what}")
        raise self.planning.not_run(f"{', '.join(names)} ({what})")

    def _model_cache_dir(self) -> str:
        """The one given, else the plan's placeholder (the parameters stay as given)."""
        return super()._model_cache_dir() or PLACEHOLDER_CACHE

    def serve(self, spec: ServeSpec):
        if not self.spec.model_cache_dir:
            self.planning.note(
                f"model_cache_dir: {PLACEHOLDER_CACHE} (where your nodes mount their "
                "NVMe instance storage: give -p model_cache_dir)")
        return super().serve(spec)

    def clean_up(self) -> None:
        """A plan applied nothing: there is nothing to delete."""
