"""Walking, writing and checking rendered objects: `pod_specs` and `embedded_scripts` (the
shell scripts inside them, for shellcheck), `to_yaml`, `validate_argv` (kubernetes-validate
--strict) and `for_kube_1_20` (what the 1.20 test control plane is given).
"""
from __future__ import annotations

import copy
import re
from typing import Any, Iterable, Mapping

import yaml

VALIDATOR = "kubernetes-validate"
# The newest Kubernetes version EKS runs among those kubernetes-validate 1.37.0 bundles
# (1.25..1.37): 1.36. The EKS user guide's version-lifecycle page names 1.36 as its newest
# version (2026), and EKS Anywhere v0.26.1 (2026-08) supports 1.33..1.36; no EKS 1.37 was found
# when this was written (2026-12). Move it when EKS adds a version the package bundles.
KUBE_VERSION = "1.36"
# The Kubernetes versions kubernetes-validate 1.37.0 bundles schemas for (KUBE_VERSION is one)
BUNDLED = re.compile(r"1\.(2[5-9]|3[0-7])(\.[0-9]+)?")
# Fields that the test control plane (Kubernetes 1.20.2, tests/kubeplane.py) does not serve as
# they are served today, so kubernetes-validate at KUBE_VERSION is their only check. Dropped
# before a dry run against 1.20 (`for_kube_1_20`).
NEWER_THAN_1_20: dict[str, str] = {
    "Job spec.ttlSecondsAfterFinished":
        "beta and on by default from 1.21; 1.20's API server drops it unless the alpha "
        "TTLAfterFinished feature gate is on",
}


def pod_specs(objects: Iterable[Mapping[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(where, pod spec) of every pod (template) in the objects: Pods, StatefulSets, Jobs and
    LeaderWorkerSets (leader and worker templates)."""
    out = []
    for obj in objects:
        kind, name = obj.get("kind"), obj.get("metadata", {}).get("name")
        spec = obj.get("spec", {})
        if kind == "Pod":
            out.append((f"Pod/{name}", spec))
        elif kind in ("StatefulSet", "Job", "Deployment", "DaemonSet"):
            out.append((f"{kind}/{name}", spec["template"]["spec"]))
        elif kind == "LeaderWorkerSet":
            lwt = spec["leaderWorkerTemplate"]
            for key in ("leaderTemplate", "workerTemplate"):
                if key in lwt:
                    out.append((f"{kind}/{name}/{key}", lwt[key]["spec"]))
    return out


def embedded_scripts(objects: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Every `bash -c` / `sh -c` script inside the objects (container commands and exec probes):
    {'where', 'shell', 'script'}, for shellcheck (`shellcheck -s <shell>`)."""
    found = []
    for where, spec in pod_specs(objects):
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            commands = [("command", c.get("command") or [])]
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if "exec" in c.get(probe, {}):
                    commands.append((probe, c[probe]["exec"]["command"]))
            for what, command in commands:
                if len(command) >= 3 and command[0] in ("bash", "sh") and command[1] == "-c":
                    found.append({"where": f"{where}/{c['name']}/{what}", "shell": command[0],
                                  "script": command[2]})
    return found


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings (the scripts read as scripts)."""


def _str(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value and not any(line != line.rstrip() for line in value.split("\n")) \
        else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(objects: Iterable[Mapping[str, Any]]) -> str:
    """The objects as one multi-document YAML text, keys sorted (so apiVersion, kind, metadata,
    spec come first and the same objects always give the same text)."""
    return yaml.dump_all([dict(o) for o in objects], Dumper=_Dumper, sort_keys=True,
                         explicit_start=True, default_flow_style=False, width=10_000,
                         allow_unicode=True)


def validate_argv(paths: Iterable[str], kube_version: str = KUBE_VERSION) -> list[str]:
    """kubernetes-validate --strict at `kube_version` (KUBE_VERSION: why that one; one of the
    versions it bundles, BUNDLED) over the files (the plan's, at least one): a misspelled or
    unknown field fails it; custom resources (LeaderWorkerSet) are skipped with a warning."""
    return [VALIDATOR, "--strict", "-k", str(kube_version), *[str(p) for p in paths]]


def for_kube_1_20(objects: Iterable[Mapping[str, Any]]) -> list[dict]:
    """Copies without the fields NEWER_THAN_1_20 lists, for a dry run against the 1.20 test
    control plane (kubernetes-validate at KUBE_VERSION checks them)."""
    out = []
    for obj in objects:
        obj = copy.deepcopy(dict(obj))
        if obj.get("kind") == "Job":
            obj.get("spec", {}).pop("ttlSecondsAfterFinished", None)
        out.append(obj)
    return out
