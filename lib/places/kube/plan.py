"""The kube place in the door's plan mode (context plan, lib.places.planning): the same KubePlace,
whose effects, while its door plans, are these records. Where it would apply, the objects are
written into the stage's `manifests/` folder and checked (`kubernetes-validate --strict` at the
Kubernetes version EKS runs, shellcheck on every embedded script; gates), and the kubectl
command is recorded (`door.plan`); where it would wait for pods or read logs, it stops with its
one SKIP reason.

Values it cannot know are placeholders, said in its notes: the image (the tag 02 gives the
build of these pins), the model cache directory and the nodes' names.
"""
from __future__ import annotations

from typing import Any

from lib.core.evidence import gate
import lib.places.kube.manifests as manifests  # the renderers themselves, not lib.places (no cycle through it)
from lib.places.planning import Planning, planned_image, tool

PLACEHOLDER_CACHE = "/mnt/instance-store/hf-cache"  # said in the plan: set model_cache_dir


class KubePlanned(Planning):
    """What a KubePlace does where it would act on a cluster, while its door plans (the place's
    `planned`): objects rendered into manifests/, checked, and the kubectl commands recorded;
    nothing applied, nothing waited for. It says its placeholders and its one reason as every
    plan does (lib.places.planning.Planning)."""

    def __init__(self, place):
        super().__init__(place.door, target="kube", verb="applies", past="applied",
                         kept="the objects are in manifests/, checked, and the kubectl commands "
                              "in the transcript")
        self.place, self.stage = place, place.stage

    # ---- what a plan cannot know ----------------------------------------------------------
    def image(self) -> str:
        image = self.place.spec.image
        if not image:
            image = planned_image(self.stage)
            self.note(f"image: {image} (02's tag for these pins; give -p image "
                      "<registry>/<name>@sha256:... to plan the image you pushed)")
        return image

    def nodes(self) -> list[dict]:
        spec = self.place.spec
        nodes = [{"metadata": {"name": f"node-{k}", "labels": {
            manifests.INSTANCE_TYPE_LABEL: spec.instance_type}},
            "status": {"allocatable": {manifests.GPU_RESOURCE: str(spec.gpus_per_node),
                                       manifests.EFA_RESOURCE: str(spec.efa_per_node)},
                "conditions": [{"type": "Ready", "status": "True"}]}}
            for k in range(spec.nodes)]
        self.note(f"nodes: node-0..node-{spec.nodes - 1} stand for the cluster's "
                  f"{spec.instance_type} nodes (kubectl get nodes names them)")
        return nodes

    def model_cache_dir(self) -> str:
        """The one given, else the plan's placeholder (the parameters stay as given)."""
        return self.place.spec.model_cache_dir or PLACEHOLDER_CACHE

    def before_serve(self) -> None:
        """The model cache's placeholder said as the serve is planned, when none was given."""
        if not self.place.spec.model_cache_dir:
            self.note(f"model_cache_dir: {PLACEHOLDER_CACHE} (where your nodes mount their "
                      "NVMe instance storage: give -p model_cache_dir)")

    # ---- effects turned into records ------------------------------------------------------
    def run(self, *args: str):
        """A kubectl call: a delete is recorded (clean-up); anything else needs the cluster's
        answer, where the plan stops."""
        if args and args[0] in ("delete",):
            self.door.plan(self.place.kubectl(*args), note="clean-up")
            return None
        if args[:1] == ("version",):
            raise self.not_run("the cluster's version")
        raise self.not_run(f"kubectl {args[0]}")

    def host_facts(self) -> list[dict[str, Any]]:
        facts = [{"node": n["metadata"]["name"]} for n in self.place.nodes()]
        objects = [manifests.node_probe_pod(run_id=self.stage.run_id, node=f["node"],
                                            image=self.place._image(),
                                            namespace=self.place.namespace,
                                            stage=self.stage.name) for f in facts]
        self.apply(objects, "node-probes")
        raise self.not_run(f"the node probe ({len(objects)} pods)")

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
        self.door.plan(self.place.kubectl("apply", "-f", rel), note=f"apply {name}")
        return rel

    def wait_pods(self, names: list[str], *, done: bool, timeout_s: float) -> dict[str, dict]:
        what = "finished" if done else "ready"
        self.door.plan(self.place.kubectl("wait", "--for", "condition=" + (
            "Ready" if not done else "complete"), "--timeout", f"{int(timeout_s)}s",
            *[f"pod/{n}" for n in names]), note=f"wait until {what}")
        raise self.not_run(f"{', '.join(names)} ({what})")
