"""lib.places.kube.manifests: the kube place's objects, checked by the real tools.

- kubernetes-validate --strict (the real binary of this environment) at the module's version:
  every rendered object passes, a misspelled field fails;
- real bash runs the serve's entrypoint for ordinals 0 and 1 with a fake `vllm`/`python3` first
  on PATH that prints its argv, and the worker probe in its own PID namespace;
- real sh runs the node probe over a fake host tree and this machine's own, and the AIPerf
  job's script with a fake AIPerf, whose printed artifacts come back through stream.unpack;
- shellcheck on every embedded script;
- where the test control plane is built (tests/kubeplane.py, Kubernetes 1.20.2): kubectl apply
  --dry-run=server of the Services, StatefulSet, Pods and Job, a GPU request != limit refused
  by it, and the HTTP Service's selector against the pods the real StatefulSet controller makes.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kubeplane import kube_plane, plane_unavailable_reason  # noqa: F401 - the fixture
from lib.core.errors import ParameterError
from lib.engines import deepep
from lib.engines.vllm_args import CLI_MODULE
from lib.places.kube import manifests as mf
from lib.places.kube.files import guide_files
from lib.places import stream
from lib.stages import registry

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
IMAGE = "registry.example/guide/deepep-v2-efa@sha256:" + "5e" * 32
TAGGED = "registry.example/guide/deepep-v2-efa:pins-0123456789ab"
RUN = "run-20261201-a"
NS = mf.DEFAULT_NAMESPACE
SERVE = dict(run_id=RUN, image=IMAGE, model_cache_dir="/mnt/nvme/hf-cache",
             hf_token_secret="hf-token")
NODES = ("ip-10-1-2-3.ec2.internal", "ip-10-1-2-4.ec2.internal")


def tool(name: str) -> str:
    """The real binary: this environment's (requirements.txt), else PATH's."""
    path = BIN / name
    found = str(path) if os.access(path, os.X_OK) else shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed: pip install -r requirements.txt", pytrace=False)
    return found


def aiperf_argv(url: str) -> list[str]:
    return ["aiperf", "profile", "--url", url, "--model", "Qwen/Qwen3-30B-A3B-FP8",
            "--artifact-dir", f"{mf.ARTIFACT_ROOT}/aiperf", "--concurrency", "8"]


def kernel_objects(**kw) -> list[dict]:
    return mf.kernel_test_objects(run_id=RUN, image=IMAGE, nodes=2,
                                  tests_dir="/opt/DeepEP/tests/elastic", num_tokens=128,
                                  hidden=7168, num_topk=8, num_experts=256, **kw)


def everything() -> dict[str, list[dict]]:
    """Every kind of rendering, by what it is."""
    return {
        "statefulset": mf.vllm_objects(**SERVE),
        "leaderworkerset": mf.leaderworkerset_objects(**SERVE),
        "allgather": mf.vllm_objects(**{**SERVE, "backend": "allgather_reducescatter",
                                        "image": TAGGED, "hf_token_secret": None,
                                        "python": "/usr/bin/python3", "enforce_eager": False}),
        "kernel": kernel_objects(timeout_s=1800, modules=guide_files(deepep.TEST_EP_MODULES)),
        "probes": [mf.node_probe_pod(run_id=RUN, node=n, image=IMAGE) for n in NODES],
        "aiperf": [mf.aiperf_job(run_id=RUN, image=IMAGE, argv=aiperf_argv),
                   mf.aiperf_job(run_id=RUN, image=IMAGE, argv=aiperf_argv, name="aiperf-cached",
                                 leader_cache=mf.LeaderCache(
                                     SERVE["model_cache_dir"],
                                     mf.leader_selector(RUN, mf.DEFAULT_SERVE_NAME)))],
    }


def all_objects() -> list[dict]:
    return [o for objs in everything().values() for o in objs]


def containers(objects):
    for where, spec in mf.pod_specs(objects):
        for c in spec["containers"]:
            yield where, spec, c


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def matches(selector: dict, pod_labels: dict) -> bool:
    return all(pod_labels.get(k) == v for k, v in selector.items())


# ---- labels -----------------------------------------------------------------------------------
def test_labels_carry_the_run_and_a_long_run_id_becomes_a_valid_value():
    assert mf.labels(RUN, "04_serve", "serve") == {
        mf.RUN_LABEL: RUN, mf.STAGE_LABEL: "04_serve", mf.ROLE_LABEL: "serve"}
    assert mf.run_selector(RUN) == f"guide.repro/run={RUN}"
    long_id, other = "a" * 64, "a" * 63 + "b"
    for rid in (long_id, other, "run.", "run_", "x" * 40 + "-" * 23 + "y"):
        value = mf.run_label_value(rid)
        assert len(value) <= 63 and mf.LABEL_VALUE_RULE.match(value), (rid, value)
        assert value == mf.run_label_value(rid)  # deterministic
    assert mf.run_label_value(long_id) != mf.run_label_value(other)
    assert mf.run_label_value("run.").startswith("run-")
    # a run id is the `run_id` parameter's (its rule refuses the rest, naming it, before any
    # effect) or one the guide makes (lib.core.stage.new_run_id); a stage's name is the
    # registry's: every one is a label value
    for bad in ("-run", "a..b", "a/b", "a" * 65):
        with pytest.raises(ParameterError, match="parameter 'run_id'"):
            registry.resolve("04_serve", {"context": "kube", "run_id": bad})
    from lib.core.stage import new_run_id
    for rid in (RUN, new_run_id(REPO / "results", "plan")):
        assert mf.LABEL_VALUE_RULE.match(mf.run_label_value(rid))
    for stage in registry.STAGES:
        assert len(stage) <= mf.LABEL_VALUE_MAX and mf.LABEL_VALUE_RULE.match(stage), stage
    for obj in all_objects():
        assert obj["metadata"]["labels"][mf.RUN_LABEL] == RUN, obj["metadata"]["name"]


# ---- kubernetes-validate ----------------------------------------------------------------------
def validate(path: Path) -> subprocess.CompletedProcess:
    argv = mf.validate_argv([path])
    return subprocess.run([tool(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=60)


def test_every_object_passes_kubernetes_validate_strict(tmp_path):
    objects = all_objects()
    path = tmp_path / "all.yaml"
    path.write_text(mf.to_yaml(objects))
    assert mf.to_yaml(objects) == path.read_text()  # stable
    assert list(yaml.safe_load_all(path.read_text())) == objects  # round trip
    proc = validate(path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    builtin = [o for o in objects if o["kind"] != "LeaderWorkerSet"]
    passed = [line for line in out.splitlines() if " passed for resource " in line]
    assert len(passed) == len(builtin), out
    assert all(f"against version {mf.KUBE_VERSION}" in line for line in passed)
    # The custom resource is skipped, not checked: its structure is tested below.
    assert "Couldn't find schema for kind LeaderWorkerSet" in out


@pytest.mark.parametrize("where", ["container", "statefulset"])
def test_a_misspelled_field_fails_kubernetes_validate_strict(tmp_path, where):
    objects = mf.vllm_objects(**SERVE)
    sts = next(o for o in objects if o["kind"] == "StatefulSet")
    if where == "container":
        c = sts["spec"]["template"]["spec"]["containers"][0]
        c["resourses"] = c.pop("resources")
        wrong = "resourses"
    else:
        sts["spec"]["podManagmentPolicy"] = sts["spec"].pop("podManagementPolicy")
        wrong = "podManagmentPolicy"
    path = tmp_path / "bad.yaml"
    path.write_text(mf.to_yaml(objects))
    proc = validate(path)
    assert proc.returncode != 0
    assert f"'{wrong}' was unexpected" in proc.stdout + proc.stderr


def test_validate_argv_names_the_strict_check_at_a_version_it_bundles():
    from lib.places.kube.manifests.output import BUNDLED

    assert mf.validate_argv(["a.yaml", Path("b.yaml")]) == [
        "kubernetes-validate", "--strict", "-k", mf.KUBE_VERSION, "a.yaml", "b.yaml"]
    assert mf.KUBE_VERSION >= "1.32" and BUNDLED.fullmatch(mf.KUBE_VERSION)
    assert not [v for v in ("1.24", "2.0", "latest") if BUNDLED.fullmatch(v)]


# ---- the serve's entrypoint, run by bash ------------------------------------------------------
FAKE = """#!{python}
import json, os, sys
print(json.dumps({{"argv": [os.path.basename(sys.argv[0])] + sys.argv[1:],
                  "ibgda": os.environ.get("NVSHMEM_IB_ENABLE_IBGDA"),
                  "ep_num_comms": os.environ.get("EP_NUM_COMMS"),
                  "hf_home": os.environ.get("HF_HOME")}}))
"""


@pytest.fixture(scope="module")
def fake_bin(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fakebin")
    for name in ("vllm", "python3", "sglang", "mpirun"):
        (d / name).write_text(FAKE.format(python=sys.executable))
        (d / name).chmod(0o755)
    return d


def serve_container(objects) -> dict:
    return next(c for _, _, c in containers(objects))


def run_entrypoint(script: str, container: dict, fake_bin: Path, **env) -> subprocess.CompletedProcess:
    full = {**env_of(container), "PATH": f"{fake_bin}:/usr/bin:/bin",
            "NVSHMEM_IB_ENABLE_IBGDA": "1", **env}
    return subprocess.run(["bash", "-c", script], env=full, capture_output=True, text=True,
                          timeout=30)


def pairs(argv: list[str]) -> list[tuple[str, str]]:
    return list(zip(argv, argv[1:]))


@pytest.mark.parametrize("python", [None, "python3"])
def test_the_entrypoint_execs_the_leader_on_0_and_a_headless_worker_on_1(fake_bin, python):
    params = {**SERVE, "ep_num_comms": 8, "python": python}
    container = serve_container(mf.vllm_objects(**params))
    script = container["command"][2]
    assert container["command"][:2] == ["bash", "-c"]
    assert script == mf.entrypoint_script(**params)
    seen = {}
    for ordinal in (0, 1):
        proc = run_entrypoint(script, container, fake_bin, HOSTNAME=f"vllm-{ordinal}")
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout.splitlines()[-1])
        assert out["ibgda"] is None  # the transport's unset variable is removed
        assert out["ep_num_comms"] == "8" and out["hf_home"] == mf.MODEL_CACHE_PATH
        argv = out["argv"]
        program = ["vllm", "serve"] if python is None else ["python3", "-m", CLI_MODULE, "serve"]
        assert argv[:len(program) + 1] == program + ["Qwen/Qwen3-30B-A3B-FP8"]
        for flag in ("--all2all-backend", "--enable-expert-parallel"):
            assert flag in argv
        assert ("--all2all-backend", "deepep_v2") in pairs(argv)
        assert {("--data-parallel-size", "16"), ("--data-parallel-size-local", "8"),
                ("--data-parallel-address", "vllm-0.vllm.deepep-repro.svc"),
                ("--data-parallel-rpc-port", str(mf.DP_RPC_PORT)),
                ("--revision", "d206ba732169f29bb77fbf80fc2c4b81d4d30782")} <= set(pairs(argv))
        assert "--enforce-eager" in argv
        seen[ordinal] = argv
        assert (argv, env_of(container)["EP_NUM_COMMS"]) == (mf.serve_argv(ordinal, **params)[0], "8")
    assert ("--data-parallel-start-rank", "0") in pairs(seen[0]) and ("--port", "8000") in pairs(seen[0])
    assert "--headless" not in seen[0]
    assert "--headless" in seen[1] and ("--data-parallel-start-rank", "8") in pairs(seen[1])
    assert "--port" not in seen[1]


def test_the_entrypoint_refuses_a_hostname_or_ordinal_it_does_not_serve(fake_bin):
    container = serve_container(mf.vllm_objects(**SERVE))
    script = container["command"][2]
    for host in ("vllm-2", "ip-10-1-2-3", "other-0", "vllm-x"):
        proc = run_entrypoint(script, container, fake_bin, HOSTNAME=host)
        assert proc.returncode == 64 and not proc.stdout.strip().startswith("{"), host
        assert "guide-entrypoint" in proc.stderr


def test_the_leaderworkerset_renders_the_same_serve(fake_bin):
    objects = mf.leaderworkerset_objects(**SERVE)
    http, lws = objects
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["kind"] == "LeaderWorkerSet"
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert lwt["size"] == 2 and lws["spec"]["replicas"] == 1
    leader_t, worker_t = lwt["leaderTemplate"], lwt["workerTemplate"]
    assert matches(http["spec"]["selector"], leader_t["metadata"]["labels"])
    assert not matches(http["spec"]["selector"], worker_t["metadata"]["labels"])
    leader_c, worker_c = leader_t["spec"]["containers"][0], worker_t["spec"]["containers"][0]
    assert leader_c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "[v]llm serve" in worker_c["readinessProbe"]["exec"]["command"][2]
    for container, index, want in ((leader_c, "0", 0), (worker_c, "1", 1)):
        proc = run_entrypoint(container["command"][2], container, fake_bin, **lws_env(index))
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout.splitlines()[-1])["argv"][1:] == \
            as_lws(mf.serve_argv(want, **SERVE)[0][1:], "vllm")
    # the leader's template does not run a worker, nor the worker's the leader
    assert run_entrypoint(leader_c["command"][2], leader_c, fake_bin, **lws_env("1")).returncode == 64
    assert run_entrypoint(worker_c["command"][2], worker_c, fake_bin, **lws_env("0")).returncode == 64


def lws_env(index: str, name: str = "vllm") -> dict[str, str]:
    """What the LWS controller sets in a pod of group 0 (its docs' LWS_LEADER_ADDRESS form)."""
    return {"LWS_WORKER_INDEX": index, "LWS_LEADER_ADDRESS": f"{name}-0.{name}.{NS}"}


def as_lws(argv: list[str], name: str, nodes: int = 2) -> list[str]:
    """A StatefulSet argv with its nodes' addresses (`<name>-k.<name>.<ns>.svc`) as the LWS
    group's (`<name>-0`, `<name>-0-k` on the LWS's Service): what tests/test_kube_lws.py runs
    for every engine."""
    for k in range(nodes):
        pod = f"{name}-0" if k == 0 else f"{name}-0-{k}"
        argv = [t.replace(f"{name}-{k}.{name}.{NS}.svc", f"{pod}.{name}.{NS}") for t in argv]
    return argv


@pytest.mark.parametrize("engine, leader_words, worker_words", [
    ("sglang", ["sglang", "serve"], ["sglang", "serve"]),
    ("trtllm", ["mpirun"], ["/usr/sbin/sshd"]),
])
def test_every_engine_renders_into_both_shapes_and_each_index_runs_its_own_argv(
        fake_bin, engine, leader_words, worker_words):
    """The StatefulSet and the LeaderWorkerSet of another engine: each ordinal (StatefulSet
    hostname, LWS_WORKER_INDEX) execs the argv the engine rendered for it: SGLang's node rank,
    TensorRT-LLM's mpirun on the leader and sshd on the worker (whose absolute path no fake
    stands in for: its branch is read, not run)."""
    params = {**SERVE, "engine": engine, "name": engine}
    want = {k: mf.serve_argv(k, **params)[0] for k in (0, 1)}
    assert want[0][:len(leader_words)] == leader_words
    assert want[1][:len(worker_words)] == worker_words
    if engine == "sglang":
        assert ("--node-rank", "0") in pairs(want[0]) and ("--node-rank", "1") in pairs(want[1])
    sts = serve_container(mf.vllm_objects(**params))
    _, lws = mf.leaderworkerset_objects(**params)
    lwt = lws["spec"]["leaderWorkerTemplate"]
    leader_c = lwt["leaderTemplate"]["spec"]["containers"][0]
    worker_c = lwt["workerTemplate"]["spec"]["containers"][0]
    assert sts["name"] == leader_c["name"] == worker_c["name"] == engine
    runs = [(sts, {"HOSTNAME": f"{engine}-0"}, 0), (leader_c, lws_env("0", engine), 0)]
    if engine == "sglang":
        runs += [(sts, {"HOSTNAME": f"{engine}-1"}, 1), (worker_c, lws_env("1", engine), 1)]
    else:
        assert "exec /usr/sbin/sshd -D -e -p 2222" in worker_c["command"][2]
    for container, env, index in runs:
        proc = run_entrypoint(container["command"][2], container, fake_bin, **env)
        assert proc.returncode == 0, proc.stderr
        expected = as_lws(want[index], engine) if "LWS_WORKER_INDEX" in env else want[index]
        assert json.loads(proc.stdout.splitlines()[-1])["argv"] == expected, (env, index)


# ---- shellcheck -------------------------------------------------------------------------------
def test_every_embedded_script_is_shellcheck_clean(tmp_path):
    scripts = mf.embedded_scripts(all_objects())
    shells = {s["shell"] for s in scripts}
    assert shells == {"bash", "sh"}
    wheres = " ".join(s["where"] for s in scripts)
    for part in ("StatefulSet/vllm/vllm/command", "readinessProbe", "Job/aiperf", "Pod/guide-probe"):
        assert part in wheres
    unique = {(s["shell"], s["script"]) for s in scripts}
    files = []
    for i, (shell, script) in enumerate(sorted(unique)):
        f = tmp_path / f"s{i}.{shell}"
        f.write_text(script)
        files.append((shell, f))
    for shell in ("bash", "sh"):
        batch = [str(f) for s, f in files if s == shell]
        proc = subprocess.run([tool("shellcheck"), "-s", shell, *batch], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- what the objects hold ----------------------------------------------------------------------
def test_the_http_service_selects_only_pod_0():
    headless, http, sts = mf.vllm_objects(**{**SERVE, "nodes": 4})
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    assert [p["port"] for p in headless["spec"]["ports"]] == [mf.DP_RPC_PORT]  # not 8000
    assert [p["port"] for p in http["spec"]["ports"]] == [8000]
    assert sts["spec"]["replicas"] == 4 and sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
    template = sts["spec"]["template"]["metadata"]["labels"]
    assert matches(sts["spec"]["selector"]["matchLabels"], template)
    # the labels the StatefulSet controller gives each pod: the template's and its pod name
    pods = [{**template, mf.POD_NAME_LABEL: f"vllm-{o}"} for o in range(4)]
    assert [matches(http["spec"]["selector"], p) for p in pods] == [True, False, False, False]
    assert all(matches(headless["spec"]["selector"], p) for p in pods)


def test_requests_equal_limits_on_every_container():
    for where, spec, c in containers(all_objects()):
        res = c["resources"]
        assert res["requests"] == res["limits"], where
        assert {"cpu", "memory"} <= set(res["requests"]), where  # Guaranteed QoS
    for name in ("statefulset", "leaderworkerset", "kernel"):
        for where, spec, c in containers(everything()[name]):
            req = c["resources"]["requests"]
            assert (req[mf.GPU_RESOURCE], req[mf.EFA_RESOURCE], req[mf.HUGEPAGES_RESOURCE]) \
                == ("8", "16", mf.HUGEPAGES_2MI), where
            assert spec["nodeSelector"] == {mf.INSTANCE_TYPE_LABEL: "p5en.48xlarge"}
            rule = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert rule[0]["topologyKey"] == "kubernetes.io/hostname"
            shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
            assert shm["emptyDir"]["medium"] == "Memory"
    p5 = serve_container(mf.vllm_objects(**{**SERVE, "instance_type": "p5.48xlarge"}))
    assert p5["resources"]["limits"][mf.EFA_RESOURCE] == "32"


def test_privileged_only_for_gdrcopy_with_its_reason_and_no_capabilities():
    kinds = everything()
    for name, objects in kinds.items():
        for where, spec, c in containers(objects):
            sc = c.get("securityContext", {})
            kind, name_, *rest = where.split("/")
            obj = next(o for o in objects if (o["kind"], o["metadata"]["name"]) == (kind, name_))
            pod_meta = obj["metadata"] if obj["kind"] == "Pod" else (
                obj["spec"]["template"]["metadata"] if "template" in obj["spec"] else
                obj["spec"]["leaderWorkerTemplate"][rest[0]]["metadata"])
            annotations = pod_meta.get("annotations", {})
            if sc.get("privileged"):
                assert name in ("statefulset", "leaderworkerset", "kernel"), where
                assert annotations[mf.PRIVILEGED_WHY_ANNOTATION] == mf.PRIVILEGED_WHY
                assert "gdr_open" in mf.PRIVILEGED_WHY and "EPERM" in mf.PRIVILEGED_WHY
                assert "capabilities" not in sc, where
            else:
                assert mf.PRIVILEGED_WHY_ANNOTATION not in annotations, where
    assert not serve_container(kinds["allgather"])["securityContext"].get("privileged")
    probe = kinds["probes"][0]
    c = probe["spec"]["containers"][0]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["securityContext"]["runAsNonRoot"] and not c["securityContext"]["allowPrivilegeEscalation"]
    assert all(m["readOnly"] for m in c["volumeMounts"])
    assert probe["spec"]["nodeName"] == NODES[0] and probe["spec"]["restartPolicy"] == "Never"


def test_a_token_value_never_appears_only_the_secret_name(monkeypatch):
    planted = "hf_PLANTED" + "q" * 30
    monkeypatch.setenv("HF_TOKEN", planted)
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", planted)
    text = mf.to_yaml(all_objects())
    assert planted not in text
    c = serve_container(mf.vllm_objects(**SERVE))
    token = [e for e in c["env"] if e["name"] == "HF_TOKEN"]
    assert token == [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "hf-token", "key": "token", "optional": False}}}]
    assert not [e for e in serve_container(everything()["allgather"])["env"]
                if e["name"] == "HF_TOKEN"]  # no secret named: no HF_TOKEN at all
    # the env the guide renders is its own (an engine's, a transport's, test_ep's, AIPerf's):
    # no token variable is ever one of its values, whatever this process's environment holds
    for _, _, c in containers(all_objects()):
        assert not [e for e in c["env"] if e["name"] in mf.TOKEN_VARS and "value" in e], c
    from lib.places.cluster import AIPERF_ENV

    assert not set(AIPERF_ENV) & set(mf.TOKEN_VARS)


def test_three_nodes_of_the_default_model_are_refused_for_ep_divisibility():
    """Refused by the stage's model (the registry's rule), before anything is rendered."""
    for workload in ("statefulset", "leaderworkerset"):
        with pytest.raises(ParameterError) as info:
            registry.resolve("04_serve", {"context": "kube", "nodes": 3,
                                          "kube_workload": workload})
        assert info.value.name == "nodes" and "expert parallelism divisibility" in str(info.value)
        assert "128 routed experts" in str(info.value) and "1, 2, 4, 8, 16" in str(info.value)
    assert len(mf.vllm_objects(**{**SERVE, "nodes": 4})) == 3


@pytest.mark.parametrize("stage", ["04_serve", "05_sweep", "06_multicomm"])
def test_parameters_are_checked_by_the_stage_s_model_before_anything_is_rendered(stage):
    """What a serve's objects are made from is refused by the stage's typed model, naming the
    parameter (nothing below the stage checks it again): on the kube place and its plan."""
    bad = [dict(image="registry.example/guide:latest"), dict(image="registry.example/guide"),
           dict(model_cache_dir="relative/dir"), dict(hf_token_secret="Bad_Name"),
           dict(namespace="Not-A-Namespace"), dict(num_comms=17),
           dict(all2all_backend="naive"), dict(instance_type="p4d.24xlarge"),
           dict(model_revision="main"), dict(model="not a model"), dict(nodes=0),
           dict(gpus_per_node=0)]
    for context in ("kube", "plan"):
        for change in bad:
            (name, value), = change.items()
            with pytest.raises(ParameterError, match=f"parameter '{name}'"):
                registry.resolve(stage, {"context": context, "engine": "vllm", **change})
    # a plan for slurm, whose transformers serve runs on CPU nodes: no GPU asked of a node
    assert registry.resolve(stage, {"context": "plan", "plan_for": "slurm",
                                    "engine": "transformers", "gpus_per_node": 0})


def test_the_pull_policy_follows_the_image_s_form_and_the_contract_holds_over_a_job_s_env():
    assert serve_container(mf.vllm_objects(**SERVE))["imagePullPolicy"] == "IfNotPresent"
    assert serve_container(mf.vllm_objects(**{**SERVE, "image": TAGGED}))["imagePullPolicy"] == "Always"
    # the transport's contract is the pods' whatever a job's env says (the guide's jobs say the
    # same: test_ep's env is built for its contract), and its unset variables are never set
    from lib.engines.transport import transport_env, unset_vars

    for transport in ("efa", "gin_type5"):
        contract = transport_env(transport)
        gone = unset_vars(transport)
        objects = mf.rank_objects(run_id=RUN, image=IMAGE, nodes=1, argv=lambda n: ["true"],
                                  env=lambda n: {"FI_PROVIDER": "tcp", "MINE": "1",
                                                 **{v: "1" for v in gone}},
                                  transport=transport)
        env = env_of(next(c for _, _, c in containers(objects)))
        assert env["MINE"] == "1" and not set(gone) & set(env)
        assert {k: env[k] for k in contract} == dict(contract)


def test_rank_objects_make_node_0_the_rendezvous_by_dns():
    """test_ep's pods (kernel_test_objects, the kube place's form): torchrun on every node,
    one rank per GPU, --nnodes=2, the pod's node rank, the rendezvous on pod 0's DNS name and
    the rendezvous port; lib.bench.test_ep_rank gets that port (init_dist's MASTER_PORT); the
    env sets none of WORLD_SIZE/RANK/MASTER_PORT (torchrun's to set, the wrapper's to rewrite)."""
    objects = kernel_objects()
    service, pods = objects[0], objects[1:]
    assert service["spec"]["clusterIP"] == "None" and service["metadata"]["name"] == "test-ep"
    master = "test-ep-0.test-ep.deepep-repro.svc"
    for rank, pod in enumerate(pods):
        spec = pod["spec"]
        assert (spec["hostname"], spec["subdomain"]) == (f"test-ep-{rank}", "test-ep")
        assert matches(service["spec"]["selector"], pod["metadata"]["labels"])
        c = spec["containers"][0]
        env = env_of(c)
        assert not {"WORLD_SIZE", "RANK", "MASTER_PORT"} & set(env)
        assert env["MASTER_ADDR"] == master
        assert env["FI_PROVIDER"] == "efa" and env["NCCL_GIN_TYPE"] == "2"
        assert c["command"][:3] == ["env", "-u", "NVSHMEM_IB_ENABLE_IBGDA"]
        argv = c["command"][c["command"].index("python3"):]
        assert argv[:12] == [
            "python3", "-m", "torch.distributed.run", "--nproc-per-node=8", "--nnodes=2",
            f"--node-rank={rank}", f"--master-addr={master}", f"--master-port={mf.RDZV_PORT}",
            "-m", "lib.bench.test_ep_rank", str(mf.RDZV_PORT),
            "/opt/DeepEP/tests/elastic/test_ep.py"]
        assert ("--num-processes", "8") in pairs(argv)
        assert "--skip-check" not in argv and spec["restartPolicy"] == "Never"
        assert [v["name"] for v in spec["volumes"]] == ["dshm"]  # no modules asked: no ConfigMap
    assert [o["kind"] for o in objects] == ["Service", "Pod", "Pod"]


def test_a_rank_job_s_guide_files_ride_in_its_configmap_mounted_at_one_folder():
    """The files a job's processes import: one ConfigMap `<job>-modules` labelled like the job's
    other objects, each file a key ('/' as '.') put back at its path by the volume's items,
    mounted read-only at /opt/guide, and /opt/guide first on PYTHONPATH at the process's start."""
    modules = guide_files(deepep.TEST_EP_MODULES)
    objects = kernel_objects(modules=modules)
    assert [o["kind"] for o in objects] == ["Service", "ConfigMap", "Pod", "Pod"]
    config = objects[1]
    assert config["metadata"]["name"] == "test-ep-modules"
    group = objects[0]["metadata"]["labels"][mf.GROUP_LABEL]
    assert config["metadata"]["labels"][mf.GROUP_LABEL] == group == "test-ep"
    assert config["metadata"]["labels"][mf.RUN_LABEL] == mf.run_label_value(RUN)
    assert config["data"] == {
        "lib.__init__.py": "", "lib.bench.__init__.py": modules["lib/bench/__init__.py"],
        "lib.bench.test_ep_rank.py": (REPO / "lib/bench/test_ep_rank.py").read_text()}
    for pod in objects[2:]:
        spec = pod["spec"]
        (volume,) = [v for v in spec["volumes"] if v["name"] != "dshm"]
        assert volume["configMap"]["name"] == "test-ep-modules"
        assert volume["configMap"]["items"] == [{"key": p.replace("/", "."), "path": p}
                                                for p in deepep.TEST_EP_MODULES]
        c = spec["containers"][0]
        assert {"name": volume["name"], "mountPath": "/opt/guide", "readOnly": True} \
            in c["volumeMounts"]
        assert c["command"][:4] == mf.PYTHONPATH_PREFIX
        assert c["command"][4:7] == ["env", "-u", "NVSHMEM_IB_ENABLE_IBGDA"]


@pytest.mark.parametrize("image_pythonpath, expected", [
    (None, "/opt/guide"), ("/opt/aiperf", "/opt/guide:/opt/aiperf")])
def test_the_pythonpath_prefix_puts_the_guide_first_and_keeps_the_image_s_own(
        image_pythonpath, expected):
    """Run by the real sh, as the pod's start runs it: the image's PYTHONPATH (an ENV the pod
    spec cannot read) stays after the guide's folder, and the command runs with its argv."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if image_pythonpath:
        env["PYTHONPATH"] = image_pythonpath
    done = subprocess.run([*mf.PYTHONPATH_PREFIX, sys.executable, "-S", "-c",
                           "import os, sys; print(os.environ['PYTHONPATH'], sys.argv[1:])",
                           "a b", "c"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == f"{expected} ['a b', 'c']"


def test_the_guide_files_of_the_jobs_are_well_under_the_cap():
    """Today's files (03's and 07's) are a small part of what one ConfigMap may hold, each
    under its own key (a valid ConfigMap key: letters, digits, '-', '_', '.')."""
    import re

    from lib.stages.train import TRAIN_MODULES

    for paths in (deepep.TEST_EP_MODULES, TRAIN_MODULES):
        size = sum(len(p.encode()) + len(t.encode()) for p, t in guide_files(paths).items())
        assert size < mf.MODULES_MAX_BYTES / 4, (paths, size)
        keys = [mf.module_key(p) for p in paths]
        assert len(set(keys)) == len(keys), paths
        assert all(re.fullmatch(r"[-._a-zA-Z0-9]{1,253}", k) for k in keys), keys
        data = mf.modules_configmap(name="x", namespace=NS, modules=guide_files(paths),
                                    meta_labels={})["data"]
        assert sorted(data) == sorted(keys)
    assert mf.MODULES_MAX_BYTES <= 256 * 1024 // 2  # under kubectl apply's annotation cap


# ---- the node probe, run by sh ------------------------------------------------------------------
def fake_host(root: Path, *, gdrdrv: str | None, devices: dict[str, str], hugepages: int) -> Path:
    if gdrdrv is not None:
        (root / "sys/module/gdrdrv").mkdir(parents=True)
        (root / "sys/module/gdrdrv/version").write_text(gdrdrv + "\n")
    for dev, driver in devices.items():
        d = root / "sys/class/infiniband" / dev / "device"
        d.mkdir(parents=True)
        d.joinpath("uevent").write_text(f"DRIVER={driver}\nPCI_CLASS=20000\nPCI_ID=1D0F:EFA2\n")
    hp = root / "sys/kernel/mm/hugepages/hugepages-2048kB"
    hp.mkdir(parents=True)
    (hp / "nr_hugepages").write_text(f"{hugepages}\n")
    (root / "proc").mkdir(parents=True, exist_ok=True)
    (root / "proc/meminfo").write_text(
        "MemTotal:       2113253348 kB\n"
        f"HugePages_Total:    {hugepages}\nHugePages_Free:     {hugepages}\n"
        "Hugepagesize:       2048 kB\n")
    return root


def run_probe(host_root: str, node: str) -> subprocess.CompletedProcess:
    pod = mf.node_probe_pod(run_id=RUN, node=node, image=IMAGE)
    command = pod["spec"]["containers"][0]["command"]
    assert command[:2] == ["sh", "-c"]
    return subprocess.run(command, env={"PATH": "/usr/bin:/bin", "HOST_ROOT": host_root,
                                        "NODE_NAME": node}, capture_output=True, text=True,
                          timeout=30)


def test_the_probe_prints_its_line_format_and_the_parser_reads_it(tmp_path):
    devices = {"rdmap79s0": "efa", "rdmap80s0": "efa", "mlx5_0": "mlx5_core"}
    root = fake_host(tmp_path / "p5en", gdrdrv="2.5", devices=devices, hugepages=2560)
    proc = run_probe(str(root), NODES[0])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split("=")[0] for line in lines[:-1]] == [f"guide-probe {k}" for k in mf.PROBE_KEYS]
    assert lines[-1] == "guide-probe end"
    facts = mf.parse_probe_log(proc.stdout)
    assert facts == {"node": NODES[0], "gdrdrv": "2.5", "efa_devices": ["rdmap79s0", "rdmap80s0"],
                     "hugepages_total": 2560, "hugepagesize_kb": 2048, "hugepages_2mi": 2560,
                     "complete": True}
    # as `kubectl logs --prefix` shows it, among other lines
    prefixed = "starting\n" + "".join(f"[pod/x/probe] {line}\n" for line in lines)
    assert mf.parse_probe_log(prefixed) == facts
    # a node without gdrdrv, EFA or huge pages
    bare = fake_host(tmp_path / "bare", gdrdrv=None, devices={}, hugepages=0)
    facts = mf.parse_probe_log(run_probe(str(bare), "n2").stdout)
    assert (facts["gdrdrv"], facts["efa_devices"], facts["hugepages_2mi"]) == (None, [], 0)
    # cut before its end, or two logs run together
    assert not mf.parse_probe_log("\n".join(lines[:-1]))["complete"]
    with pytest.raises(ValueError):
        mf.parse_probe_log(proc.stdout + run_probe(str(bare), "n2").stdout)


def test_the_probe_reads_this_machines_own_sys_and_meminfo():
    proc = run_probe("/", "this-machine")
    assert proc.returncode == 0, proc.stderr
    facts = mf.parse_probe_log(proc.stdout)
    assert facts["complete"] and facts["node"] == "this-machine"
    assert isinstance(facts["hugepages_total"], int) and facts["hugepagesize_kb"] > 0
    assert mf.probe_pod_name(NODES[0]).startswith("guide-probe-ip-10-1-2-3-ec2-internal-")
    assert len(mf.probe_pod_name("n" * 80)) <= 63
    assert mf.probe_pod_name(NODES[0]) != mf.probe_pod_name(NODES[1])


# ---- the worker probe cannot match itself ---------------------------------------------------------
def test_the_worker_probe_finds_vllm_and_never_itself():
    argv, _ = mf.serve_argv(1, **SERVE)
    probe = mf.worker_probe_script(mf.serve_render(**SERVE).process_regex)
    # the same probe without the brackets: it finds itself, with no vLLM running
    naive = probe.replace("re='[v]llm serve'", "re='vllm serve'")
    assert naive != probe
    # the StatefulSet's one template: on a worker's hostname, the same process check
    either = serve_container(mf.vllm_objects(**SERVE))["readinessProbe"]["exec"]["command"][2]
    assert "re='[v]llm serve'" in either and "/health" in either
    inner = ("set -u\n"
             "bash -c \"$PROBE\"; alone=$?\n"
             "bash -c \"$NAIVE\"; naive=$?\n"
             "(exec -a \"$FAKE_ARGV0\" sleep 20) & pid=$!\n"
             "sleep 0.3\n"
             "bash -c \"$PROBE\"; serving=$?\n"
             "HOSTNAME=vllm-1 bash -c \"$EITHER\"; sts_worker=$?\n"
             "kill \"$pid\"\n"
             "echo \"$alone $naive $serving $sts_worker\"\n")
    # a PID namespace of its own: no process of this shared machine can answer for vLLM
    # (the scripts and the fake vLLM's name come through the environment: in this harness's own
    # command line they would be a vLLM process for the probe)
    argv_ns = ["unshare", "--pid", "--fork", "--mount-proc", "bash", "-c", inner]
    proc = subprocess.run(argv_ns, capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "PROBE": probe, "NAIVE": naive,
                               "EITHER": either,
                               "FAKE_ARGV0": " ".join(argv[:3]) + " --headless"})
    if proc.returncode and "unshare" in proc.stderr:
        pytest.skip(f"no PID namespace here: {proc.stderr.strip()}")
    assert proc.stdout.split() == ["1", "0", "0", "0"], proc.stdout + proc.stderr


# ---- AIPerf -------------------------------------------------------------------------------------
def test_the_aiperf_job_runs_once_against_the_leader_and_prints_its_artifacts(tmp_path):
    job = mf.aiperf_job(run_id=RUN, image=IMAGE, argv=aiperf_argv, timeout_s=900)
    spec = job["spec"]
    assert (spec["backoffLimit"], spec["ttlSecondsAfterFinished"], spec["activeDeadlineSeconds"]) \
        == (0, mf.AIPERF_TTL_S, 900)
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    script = pod["containers"][0]["command"][2]
    url = "http://vllm-http.deepep-repro.svc:8000"
    assert url == mf.leader_url() and f"--url {url}" in script
    assert stream.pack_command(f"{mf.ARTIFACT_ROOT}/aiperf", "aiperf") in script
    # The same script, run by sh with a fake AIPerf writing into a folder here: the files come
    # back through the log, and AIPerf's exit code is the job's.
    block = f"guide-test-{os.getpid()}-{time.monotonic_ns()}"
    art = tmp_path / "art"
    for rc in (0, 3):
        fake = [sys.executable, "-c",
                "import pathlib, sys; d = pathlib.Path(sys.argv[1]); d.mkdir(exist_ok=True); "
                "(d / 'profile_export_aiperf.json').write_text('{\"ok\": 1}'); sys.exit(int(sys.argv[2]))",
                str(art), str(rc)]
        proc = subprocess.run(["sh", "-c", mf.aiperf_script(fake, str(art), block)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == rc, proc.stderr
        got = stream.unpack(proc.stdout, block, tmp_path / f"back{rc}")
        assert [p.name for p in got] == ["profile_export_aiperf.json"]
    Path(f"/tmp/{block}.tgz").unlink(missing_ok=True)


def test_the_aiperf_job_of_a_hub_model_sits_beside_the_leader_with_its_cache_read_only():
    """With the leader's model cache: the Job's pod must share a node with the leader pod (the
    labels the HTTP Service selects it by, StatefulSet or LeaderWorkerSet), the node's model
    cache mounted read-only, HF_HOME there; a cache never comes without the leader's labels
    (one value, LeaderCache)."""
    beside = mf.leader_selector(RUN, mf.DEFAULT_SERVE_NAME)
    job = mf.aiperf_job(run_id=RUN, image=IMAGE, argv=aiperf_argv,
                        leader_cache=mf.LeaderCache("/mnt/nvme/hf-cache", beside))
    pod = job["spec"]["template"]["spec"]
    (term,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term == {"labelSelector": {"matchLabels": beside}, "topologyKey": mf.HOSTNAME_LABEL}
    container = pod["containers"][0]
    assert env_of(container)["HF_HOME"] == mf.MODEL_CACHE_PATH
    assert {"name": "model-cache", "mountPath": mf.MODEL_CACHE_PATH, "readOnly": True} \
        in container["volumeMounts"]
    assert {"name": "model-cache", "hostPath": {"path": "/mnt/nvme/hf-cache",
                                                "type": "Directory"}} in pod["volumes"]
    # the selector is the HTTP Service's: it matches pod 0 of the StatefulSet alone
    sts_objects = mf.vllm_objects(**SERVE)
    (http,) = [o for o in sts_objects if o["metadata"]["name"] == mf.http_service_name("vllm")]
    assert http["spec"]["selector"] == beside
    sts = next(o for o in sts_objects if o["kind"] == "StatefulSet")
    made = {k: {**sts["spec"]["template"]["metadata"]["labels"], mf.POD_NAME_LABEL: f"vllm-{k}"}
            for k in (0, 1)}
    assert matches(beside, made[0]) and not matches(beside, made[1])
    lws = mf.leaderworkerset_objects(**SERVE)
    (lws_http,) = [o for o in lws if o["kind"] == "Service"]
    assert lws_http["spec"]["selector"] == mf.leader_selector(RUN, "vllm", lws=True)
    # without a cache nothing of it; a cache is one value with the leader's labels, and a
    # relative model_cache_dir is refused by the stage's model, naming it
    plain = mf.aiperf_job(run_id=RUN, image=IMAGE, argv=aiperf_argv)["spec"]["template"]["spec"]
    assert "affinity" not in plain and [v["name"] for v in plain["volumes"]] == ["artifacts"]
    with pytest.raises(TypeError):
        mf.LeaderCache("/mnt/nvme/hf-cache")  # type: ignore[call-arg]
    with pytest.raises(ParameterError, match="parameter 'model_cache_dir'"):
        registry.resolve("05_sweep", {"context": "kube", "model_cache_dir": "cache"})


# ---- a real control plane (Kubernetes 1.20.2) ------------------------------------------------------
needs_plane = pytest.mark.skipif(plane_unavailable_reason() is not None,
                                 reason=str(plane_unavailable_reason()))


@needs_plane
def test_the_control_plane_accepts_them_and_refuses_a_gpu_request_unlike_its_limit(kube_plane):
    kube_plane.create_namespace(NS)
    kinds = everything()
    objects = kinds["statefulset"] + kinds["kernel"] + kinds["probes"] + kinds["aiperf"]
    proc = kube_plane.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-",
                              input=mf.to_yaml(mf.for_kube_1_20(objects)), check=False)
    assert proc.returncode == 0, proc.stderr
    answered = json.loads(proc.stdout)["items"]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in answered) \
        == sorted((o["kind"], o["metadata"]["name"]) for o in objects)
    # What 1.20 does with the field only kubernetes-validate checks: dropped, not refused.
    job = kinds["aiperf"][0]
    proc = kube_plane.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-",
                              input=mf.to_yaml([job]))
    assert "ttlSecondsAfterFinished" not in json.loads(proc.stdout)["spec"]
    # A GPU request unlike its limit: the schema passes it, the API server refuses it.
    pod = json.loads(json.dumps(next(o for o in kinds["kernel"] if o["kind"] == "Pod")))
    pod["spec"]["containers"][0]["resources"]["requests"][mf.GPU_RESOURCE] = "4"
    proc = kube_plane.kubectl("apply", "--dry-run=server", "-f", "-", input=mf.to_yaml([pod]),
                              check=False)
    assert proc.returncode != 0 and "nvidia.com/gpu" in proc.stderr and "must be equal" in proc.stderr


@needs_plane
def test_the_real_statefulset_controller_makes_pods_only_pod_0_serves_http(kube_plane):
    ns = "manifests-sts"
    kube_plane.create_namespace(ns)
    run = "run-sts"
    objects = mf.vllm_objects(**{**SERVE, "run_id": run, "namespace": ns, "nodes": 2})
    kube_plane.kubectl("apply", "-f", "-", input=mf.to_yaml(objects))
    try:
        deadline = time.monotonic() + 30
        while True:
            pods = kube_plane.get_json("pods", "-n", ns, "-l", mf.run_selector(run))["items"]
            if len(pods) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert sorted(p["metadata"]["name"] for p in pods) == ["vllm-0", "vllm-1"]
        http = objects[1]["spec"]["selector"]
        chosen = kube_plane.get_json("pods", "-n", ns, "-l",
                                     ",".join(f"{k}={v}" for k, v in http.items()))["items"]
        assert [p["metadata"]["name"] for p in chosen] == ["vllm-0"]
    finally:
        kube_plane.kubectl("delete", "statefulset,service", "-n", ns, "-l", mf.run_selector(run),
                           "--wait=false")
    left = kube_plane.get_json("statefulsets,services", "-n", ns, "-l", mf.run_selector(run))
    assert left["items"] == []
