"""A p5en cluster for the kube place's tests (not a test file): the real control plane
(tests/kubeplane.py), two nodes with p5en's allocatable, and the kubelet double playing their
kubelets with recorded and composed outputs (tests/kubelet_double.py, tests/compose.py).

    with KubeEnv(tmp_path) as env:          # KUBECONFIG points at it while open
        env.probes(gdrdrv="2.5.1")          # what each node's probe pod prints
        env.test_ep(compose.compose_test_ep(env.logs))
        env.serve("vllm", compose.compose_vllm_pods(env.logs), answers=...)
        stage = env.stage("04_serve", image=IMAGE)

Only what cannot exist here is simulated: a kubelet with GPUs (pod status, logs, exec answers).
Scheduling, StatefulSet, Job, Service and garbage collection are the real controllers'.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

try:
    from kubelet_double import Container, Exec, KubeletDouble, Script
    from kubeplane import KubePlane
except ImportError:
    from tests.kubelet_double import Container, Exec, KubeletDouble, Script
    from tests.kubeplane import KubePlane

try:
    import compose
except ImportError:
    from tests import compose

from lib.core.door import REPO_ROOT, Door
from lib.core.stage import Stage
from lib.engines import server as served
from lib.measure import agreement, sweep
from lib.places.cluster import CONFIG_SCRIPT
from lib.places.kube import manifests
from lib.places.kube.serve import REQUEST_SCRIPT
from lib.stages import registry

NODES = ("p5en-a", "p5en-b")
IMAGE = "registry.example/deepep-v2-efa@sha256:" + "ab" * 32  # any digest: no image is pulled
IMAGE_ID = "docker-pullable://registry.example/deepep-v2-efa@sha256:" + "ab" * 32
MODEL_CACHE = "/opt/dlami/nvme/hf-cache"
# Real answers of vLLM 0.24.0 on 2x H200 (run gpu-2xh200-vllm-20261201), as the leader's
# Service would give them: the model list and a chat completion.
RECORDED_RUN = REPO_ROOT / "results" / "gpu-2xh200-vllm-20261201" / "04_serve"
METRICS = (REPO_ROOT / "results" / "gpu-2xh200-vllm-20261130" / "05_sweep" / "metrics"
           / "repeat_1" / "c4.before.prom")
ANSWERS = REPO_ROOT / "results" / "diagnostics" / "vllm-answers-1xh200-20261201" / "answers.json"
VERIFY_SCRIPT = REPO_ROOT / "docker" / "verify-image.sh"


class KubeEnv:
    def __init__(self, workdir: Path, namespace: str = "deepep-repro"):
        self.workdir = Path(workdir)
        self.logs = self.workdir / "composed"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        self.plane = KubePlane()
        self.double: KubeletDouble | None = None
        self._env_before: str | None = None

    def __enter__(self) -> "KubeEnv":
        self.plane.start(self.workdir / "plane")
        self.double = KubeletDouble(self.plane).start()
        for node in NODES:
            self.double.add_node(node)
        self.plane.create_namespace(self.namespace)
        self._env_before = os.environ.get("KUBECONFIG")
        os.environ["KUBECONFIG"] = str(self.plane.kubeconfig)
        return self

    def __exit__(self, *exc) -> None:
        if self._env_before is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = self._env_before
        if self.double is not None:
            self.double.stop()
        self.plane.stop()

    # ---- stages --------------------------------------------------------------------------
    def stage(self, name: str, run_dir: Path, replay: bool = False, **given: Any) -> Stage:
        params = {"context": "kube", "namespace": self.namespace, "image": IMAGE,
                  "schedule_timeout_s": 20, "job_timeout_s": 60, "server_timeout_s": 60,
                  **given}
        resolved = registry.resolve(name, {k: v for k, v in params.items()
                                           if k in registry.STAGE_PARAMS[name]})
        if "engine" in resolved and not resolved["engine"]:
            resolved = registry.resolve(name, {**{k: v for k, v in params.items()
                                                  if k in registry.STAGE_PARAMS[name]},
                                               "engine": "vllm"})
        return Stage(name, resolved, run_dir, Door(run_dir, name, replay=replay),
                     run_dir if replay else None)

    def objects_left(self) -> list[str]:
        got = self.plane.get_json("pods,services,statefulsets,jobs", "-n", self.namespace)
        return [f"{o['kind']}/{o['metadata']['name']}" for o in got["items"]]

    # ---- what the nodes answer -----------------------------------------------------------
    def probes(self, **facts_by_default: Any) -> list[Path]:
        """Each node's probe pod prints the probe's lines (lib.places.kube.manifests.PROBE_FORMAT)
        for the facts given (a node name -> facts mapping under `per_node` overrides)."""
        per_node = facts_by_default.pop("per_node", {})
        paths = []
        for node in NODES:
            facts = {"gdrdrv": "2.5.1", "efa": 16, "hugepages_total": 4096, **facts_by_default,
                     **per_node.get(node, {})}
            path = self.logs / f"composed-node-probe-{node}.log"
            path.write_text(probe_log(node, **facts))
            self.double.add_script(Script(manifests.probe_pod_name(node), {
                "*": Container(log=path, exit_code=0, image_id=IMAGE_ID)},
                running_after=0.1, exit_after=0.3))
            paths.append(path)
        return paths

    def ranks(self, name: str, logs: Sequence[Path], exit_codes: Sequence[int] | None = None,
              pending: bool = False, exit_after: Sequence[float] | None = None) -> None:
        """The pods `<name>-<rank>`: each prints its node's log and exits with its code,
        `exit_after` seconds after it runs (2 s each unless given per rank)."""
        for rank, log in enumerate(logs):
            code = (exit_codes or [0] * len(logs))[rank]
            self.double.add_script(Script(f"{name}-{rank}", {
                "*": Container(log=log, exit_code=code, image_id=IMAGE_ID)},
                # 2 s: both ranks started before either finished, as a job's ranks do (the
                # kubelet's startedAt and finishedAt are whole seconds), under any load
                running_after=None if pending else 0.1,
                exit_after=2.0 if exit_after is None else exit_after[rank],
                pod_ips="10.244.0.0/16"))

    def verify(self, failed: Sequence[str] = ()) -> Path:
        """The pod `verify-image-0`: docker/verify-image.sh's output in its own line format
        ("PASS <check>: <detail>", "FAIL ...", the summary line), composed from the checks the
        script names; `failed` lists checks that fail (exit 1)."""
        checks = [line.split('"')[1] for line in VERIFY_SCRIPT.read_text().splitlines()
                  if line.lstrip().startswith('check "') and "${" not in line.split('"')[1]]
        lines = [f"{'FAIL' if c in failed else 'PASS'} {c}: composed for the kube tests"
                 for c in checks]
        lines.append(f"verify-image: {len(failed)} of {len(checks)} checks FAILED: "
                     + " ".join(failed) if failed else
                     f"verify-image: {len(checks)}/{len(checks)} checks PASS")
        log = self.logs / "composed-verify-image.log"
        log.write_text("\n".join(lines) + "\n")
        self.double.add_script(Script("verify-image-0", {
            "*": Container(log=log, exit_code=1 if failed else 0, image_id=IMAGE_ID)},
            running_after=0.1, exit_after=0.3, pod_ips="10.244.0.0/16"))
        return log

    def aiperf_jobs(self, names: Sequence[str], cells: Sequence[str]) -> None:
        """The AIPerf Jobs' pods `<name>-*`: each prints a recorded AIPerf 0.13 cell (its
        console tables, then its export folder as lib.places.stream prints it) and exits 0."""
        for name, cell in zip(names, cells):
            log = compose.compose_aiperf_job_log(self.logs / name, cell=cell, block=name)
            self.double.add_script(Script(f"{name}-*", {
                "*": Container(log=log, exit_code=0, image_id=IMAGE_ID)},
                running_after=0.1, exit_after=0.3, pod_ips="10.244.0.0/16"))

    def serve(self, name: str, logs: Sequence[Path], *, model: str, revision: str,
              config: dict, ready: bool = True, metrics_reads: int = 0,
              answers: str | None = None) -> None:
        """The StatefulSet's pods `<name>-<k>`: their logs, the leader Ready, and what a request
        from inside the cluster (the kube place's exec) answers: the recorded vLLM answers."""
        url = f"http://{manifests.http_service_name(name)}.{self.namespace}.svc:{manifests.HTTP_PORT}"
        models = json.loads((RECORDED_RUN / "models_response.json").read_text())
        for entry in models.get("data", []):
            entry["id"] = entry["root"] = model  # served under the cluster model's name
        chat = json.loads((RECORDED_RUN / "chat_response.json").read_text())
        chat["model"] = model
        chat_request = {"model": model, "max_tokens": 16, "messages": [
            {"role": "user", "content": served.CHAT_PROMPT}]}
        execs = {
            exec_request("GET", url + "/v1/models", served.PROBE_TIMEOUT_S, None):
                Exec(json.dumps({"status": 200, "body": json.dumps(models), "error": None})),
            exec_request("POST", url + "/v1/chat/completions", served.CHAT_TIMEOUT_S,
                         chat_request):
                Exec(json.dumps({"status": 200, "body": json.dumps(chat), "error": None})),
            ("env", "HF_HUB_OFFLINE=1", "python3", "-c", CONFIG_SCRIPT, model,
             revision): Exec(json.dumps(config)),
        }
        if metrics_reads:  # vLLM's /metrics, read before and after each cell: a counter that grows
            execs[exec_request("GET", url + "/metrics", sweep.METRICS_TIMEOUT_S, None)] = [
                Exec(json.dumps({"status": 200, "body": metrics_text(k), "error": None}))
                for k in range(metrics_reads)]
        if answers:  # the fixed prompts of lib.measure.agreement: vLLM's recorded answers
            recorded = json.loads(ANSWERS.read_text())["arms"][answers]["alone"]
            for prompt, answer in zip(agreement.PROMPTS, recorded):
                body = {"model": model, "prompt": prompt, **agreement.REQUEST}
                execs[exec_request("POST", url + "/v1/completions", agreement.ASK_TIMEOUT_S,
                                   body)] = Exec(json.dumps({"status": 200,
                                                             "body": json.dumps(answer),
                                                             "error": None}))
        for k, log in enumerate(logs):
            self.double.add_script(Script(f"{name}-{k}", {
                "*": Container(log=log, execs=execs if k == 0 else {}, image_id=IMAGE_ID)},
                running_after=0.1, ready_after=0.2 if ready else None,
                pod_ips="10.244.0.0/16"))


def metrics_text(turn: int) -> str:
    """vLLM's /metrics as a DP serve answers it, composed: the recorded text of a 2x H200 serve
    (run gpu-2xh200-vllm-20261130, before its c4 cell) with each engine's generation_tokens_total
    raised by 10000 per read, so every cell sees the server's own count grow."""
    lines = []
    for line in METRICS.read_text().splitlines():
        if line.startswith(sweep.GENERATION_TOKENS + "{"):
            head, _, value = line.rpartition(" ")
            line = f"{head} {float(value) + 10000.0 * turn}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def exec_request(method: str, url: str, timeout: float, body: dict | None) -> tuple[str, ...]:
    """The argv the kube place's server runs in the leader pod for one request."""
    return ("python3", "-c", REQUEST_SCRIPT, method, url, str(timeout),
            "" if body is None else json.dumps(body))


def probe_log(node: str, *, gdrdrv: str | None, efa: int, hugepages_total: int) -> str:
    """A node probe's output in the probe's own line format (lib.places.kube.manifests.PROBE_FORMAT),
    composed: the facts are this test's, the EFA device names p5en's rdmap pattern."""
    devices = ",".join(f"rdmap{16 + k}s27" for k in range(efa)) or "none"
    return "\n".join([
        f"guide-probe node={node}",
        f"guide-probe gdrdrv={gdrdrv or 'absent'}",
        f"guide-probe efa={devices}",
        f"guide-probe hugepages_total={hugepages_total}",
        "guide-probe hugepagesize_kb=2048",
        f"guide-probe hugepages_2mi={hugepages_total}",
        "guide-probe end", ""])


def model_config(recorded: Path, *, experts: int, top_k: int) -> dict:
    """The cluster model's config.json, composed from a recorded Qwen3-MoE config (the seeded
    model vLLM served on 2x H200) with the default model's expert counts (lib.engines.model_facts:
    128 routed experts, top-8)."""
    config = json.loads(recorded.read_text())
    config.update(num_experts=experts, num_experts_per_tok=top_k)
    return config


# ---- faults (tests/test_kube_faults.py) --------------------------------------------------------
def pull_failure_message(image: str) -> str:
    """What the kubelet puts in a container's waiting message when containerd finds no such
    image at the registry, in its real form (recorded in cloudnative-pg/cloudnative-pg#2265 and
    sympozium-ai/sympozium#5: 'Failed to pull image "X": rpc error: code = NotFound desc =
    failed to pull and unpack image "X": failed to resolve reference "X": X: not found')."""
    return (f'Failed to pull image "{image}": rpc error: code = NotFound desc = failed to pull '
            f'and unpack image "{image}": failed to resolve reference "{image}": {image}: '
            "not found")


def image_cannot_be_pulled(env: KubeEnv, pods: str, image: str, backoff_after: float = 10.0) -> str:
    """The pods matching `pods` never start: their container waits ErrImagePull with the
    registry's message, then (after `backoff_after` s) ImagePullBackOff with the kubelet's
    'Back-off pulling image "X"' (Shopify/krane#124, awslabs/benchmark-ai#843), Pending
    throughout. Returns the ErrImagePull message."""
    message = pull_failure_message(image)
    env.double.add_script(Script(pods, {"*": Container(image_id=IMAGE_ID)}, running_after=None,
                                 waiting_turns=[(0.0, "ErrImagePull", message),
                                                (backoff_after, "ImagePullBackOff",
                                                 f'Back-off pulling image "{image}"')]))
    return message


def on_request(env: KubeEnv, name: str, path: str, action) -> None:
    """The leader `<name>-0`'s answer to the request for `path` (a kube serve's exec, as
    KubeEnv.serve scripted it) calls `action()` first: a fault at that point of the stage."""
    import dataclasses

    container = env.double.script_for(f"{name}-0").container("*")
    for key, answer in list(container.execs.items()):
        if len(key) > 4 and key[4].endswith(path):
            container.execs[key] = dataclasses.replace(answer, then=action)
            return
    raise KeyError(f"{name}-0 answers no request for {path}")

