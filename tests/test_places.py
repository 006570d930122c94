"""Places: the door's plan mode, the plan place, the place each context picks, and the engine
default that comes from the place (never from this machine's GPUs on a cluster place)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lib import places
from lib.core.door import Door, read_transcript
from lib.core.errors import PlanOnly, ReplayMismatch
from lib.core.stage import Stage
from lib.places import NodeRank, RankJob, Unsupported
from lib.places.kube.place import KubePlace
from lib.places.local import LocalPlace
from lib.places.slurm.place import SlurmPlace
from lib.stages import kernel, registry
from lib.stages.opening import open_stage


def plan_stage(run_dir, name="03_kernel_test", given=None, replay=False) -> Stage:
    resolved = registry.resolve(name, {"context": "plan", **(given or {})})
    door = Door(run_dir, name, replay=replay, plan=True)
    return Stage(name, resolved, run_dir, door, run_dir if replay else None)


def test_the_plan_door_runs_checkers_only_and_records_what_it_would_run(tmp_path):
    door = Door(tmp_path, "03_kernel_test", plan=True)
    with pytest.raises(PlanOnly, match="context plan runs nothing but local checkers"):
        door.run(["kubectl", "apply", "-f", "x.yaml"], timeout=5)
    with pytest.raises(PlanOnly, match="starts no process"):
        door.start(["sleep", "60"], log_path=tmp_path / "x.log")
    with pytest.raises(PlanOnly, match="sends no request"):
        door.http("GET", "http://127.0.0.1:9/health", timeout=1)
    script = tmp_path / "ok.sh"
    script.write_text("#!/bin/bash\necho ok\n")
    checked = door.run([".venv/bin/shellcheck", str(script)], timeout=60, check=False)
    assert checked.rc == 0  # a local checker runs for real
    door.plan(["kubectl", "apply", "-f", "x.yaml"], note="the serve")
    kinds = [(e["kind"], e["key"][0]) for e in read_transcript(tmp_path / "transcript.jsonl")]
    assert kinds == [("run", ".venv/bin/shellcheck"), ("plan", "kubectl")]
    # a replay answers the same plan at the same point, and refuses another
    replay = Door(tmp_path, "03_kernel_test", replay=True)
    replay.run([".venv/bin/shellcheck", str(script)], timeout=60, check=False)
    with pytest.raises(ReplayMismatch, match="plan"):
        replay.plan(["kubectl", "delete", "-f", "x.yaml"])


def test_a_plan_for_slurm_is_the_slurm_place_planning(tmp_path):
    stage = plan_stage(tmp_path, given={"plan_for": "slurm"})
    place = places.for_stage(stage)
    assert type(place) is SlurmPlace and place.plans_only and place.gpus() == 8
    job = RankJob("the torch benchmark",
                  argv=lambda node: kernel.torchrun_argv(kernel.bench_config(stage, 8), node,
                                                         "out.json"),
                  env=lambda node: {"NODE_RANK": str(node.rank)}, timeout_s=60, nodes=2)
    with pytest.raises(Unsupported, match="plan for slurm: the torch benchmark on 2 node"):
        place.run_ranks(job)
    planned = [e["key"] for e in read_transcript(tmp_path / "transcript.jsonl")
               if e["kind"] == "plan" and e["key"][0] != "#"]
    assert [a[0] for a in planned] == ["sbatch", "srun", "scancel"]
    script = planned[1][-2]
    for rank in (0, 1):
        assert f"--node-rank={rank}" in script and f"NODE_RANK={rank}" in script
    assert "--nnodes=2" in script and "--nproc-per-node=8" in script
    assert "--master-addr=node-0" in script


def test_03_planned_for_kube_renders_checks_and_records_and_replays(tmp_path):
    """The kube place's own code, planning: DeepEP's test_ep as one pod per node per token
    count, written into manifests/, checked by kubernetes-validate --strict (a real run of the
    checker), the kubectl commands recorded; nothing applied; a replay gives the same."""
    stage = plan_stage(tmp_path)
    assert type(places.for_stage(stage)) is KubePlace and places.for_stage(stage).plans_only
    kernel.run(stage)
    stage.finish()
    got = {g.gate: g for g in stage.gates}
    assert got["the torch benchmark"].status == "SKIP"
    for tokens in (128, 512, 4096):
        valid = got[f"test-ep-at-{tokens}-tokens: manifests valid (kubernetes-validate --strict "
                    "1.36)"]
        assert valid.status == "PASS" and "passed" in valid.reason
        assert got[f"test_ep {tokens} tokens: test_ep run"].status == "SKIP"
        assert "planned, not run" in got[f"test_ep {tokens} tokens: test_ep run"].reason
        text = (tmp_path / "03_kernel_test" / "manifests" / f"test-ep-at-{tokens}-tokens.yaml"
                ).read_text()
        assert "kind: Pod" in text and f"test-ep-at-{tokens}-tokens-1" in text
        # test_ep under torchrun: its entry (lib.bench.test_ep_rank) rides in the job's
        # ConfigMap, put on PYTHONPATH by a `sh -c` start that the plan shellchecks
        assert f"name: test-ep-at-{tokens}-tokens-modules" in text
        assert "lib.bench.test_ep_rank" in text and "kind: ConfigMap" in text
        checked = [g for name, g in got.items() if name.startswith(
            f"test-ep-at-{tokens}-tokens: shellcheck clean")]
        assert len(checked) == 2 and {g.status for g in checked} == {"PASS"}  # one per pod
    entries = read_transcript(tmp_path / "transcript.jsonl")
    assert {e["kind"] for e in entries} == {"plan", "run"}
    assert {e["key"][0] for e in entries if e["kind"] == "run"} == {
        "{bin}/kubernetes-validate", "{bin}/shellcheck"}
    applies = [e["key"] for e in entries if e["kind"] == "plan" and "apply" in e["key"]]
    assert len(applies) == 3
    replay = plan_stage(tmp_path, replay=True)
    kernel.run(replay)
    replay.finish()  # the same plan, the same gates


def test_a_plan_names_the_image_of_the_pins_its_run_recorded(tmp_path):
    """02's tag comes from the pins digest in run.json: a plan replayed after pins.yaml moved on
    still names the image it planned (the tag CI's replay of a committed plan asks for)."""
    from lib.places.planning import planned_image
    from lib.roots import pins

    stage = plan_stage(tmp_path)
    assert planned_image(stage) == f"deepep-v2-efa:pins-{pins.digest()[:12]}"  # no run.json yet
    (tmp_path / "run.json").write_text(json.dumps({"pins_digest": "0123456789ab" + "f" * 52}))
    assert planned_image(stage) == "deepep-v2-efa:pins-0123456789ab"
    kernel.run(stage)
    notes = [e["key"][1] for e in read_transcript(tmp_path / "transcript.jsonl")
             if e["kind"] == "plan" and e["key"][0] == "#"]
    assert any(n.startswith("image: deepep-v2-efa:pins-0123456789ab ") for n in notes)


@pytest.mark.parametrize("context, kind", [("local", LocalPlace), ("plan", KubePlace),
                                           ("kube", KubePlace), ("slurm", SlurmPlace)])
def test_each_context_has_its_place(tmp_path, context, kind):
    """A plan is the kube place (plan_for's default) with its door in plan mode."""
    stage = Stage("00_cluster", registry.resolve("00_cluster", {"context": context}), tmp_path,
                  Door(tmp_path, "00_cluster", plan=context == "plan"), None)
    assert type(places.for_stage(stage)) is kind
    assert places.for_stage(stage) is places.for_stage(stage)  # one place per stage
    assert places.for_stage(stage).plans_only == (context == "plan")


def test_a_plan_whose_door_does_not_plan_is_refused_before_any_effect(tmp_path):
    """Context plan with a door that runs what it is asked would be a cluster place acting:
    refused when the place is made, nothing recorded."""
    stage = Stage("00_cluster", registry.resolve("00_cluster", {"context": "plan"}), tmp_path,
                  Door(tmp_path, "00_cluster"), None)
    with pytest.raises(ValueError, match="context plan needs the stage's door in plan mode"):
        places.for_stage(stage)
    assert not (tmp_path / "transcript.jsonl").exists()


def test_a_cluster_place_serves_with_vllm_whatever_this_machine_has(tmp_path):
    """The engine '' resolves to the place's pick: vLLM on kube, slurm and plan, though this
    machine has no GPU (where the local place picks transformers)."""
    for context in ("kube", "slurm", "plan"):
        assert places.engine_default(places.PlaceSpec(context=context)) == "vllm"
        assert places.engine_refusal(places.PlaceSpec(context=context, engine="vllm")) is None
    assert places.engine_default(places.PlaceSpec(context="local")) == "transformers"
    # values not yet made into a spec are made into one by the stage layer (lib.stages.specs)
    assert places.engine_default({"context": "local"}) == "transformers"
    ns = {"context": "plan", "results_dir": str(tmp_path), "run_id": "p1"}
    stage = open_stage("04_serve", ns)
    assert stage["engine"] == "vllm" and stage.door.planning
    run = json.loads((tmp_path / "p1" / "run.json").read_text())
    assert run["parameters"]["engine"] == "vllm" and run["outputs_version"] == 2


def test_01_opens_without_plan_mode_it_touches_no_place(tmp_path):
    ns = {"context": "plan", "results_dir": str(tmp_path), "run_id": "p2"}
    assert not open_stage("01_public_roots", ns).door.planning
    assert open_stage("00_cluster", ns).door.planning


def test_places_that_are_not_built_say_so_in_one_reason(tmp_path, monkeypatch):
    from lib.core.errors import PlaceError

    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "absent.conf"))  # no Slurm answers
    # sinfo retries a missing configuration for 60 s: the place's query timeout ends it sooner
    monkeypatch.setattr("lib.places.slurm.waits.QUERY_TIMEOUT_S", 3.0)
    stage = Stage("03_kernel_test", registry.resolve("03_kernel_test", {"context": "slurm"}),
                  tmp_path, Door(tmp_path, "03_kernel_test"), None)
    # no image, no venv: a SKIP once the cluster answered (test_slurm_place); here none does,
    # and that is said first, as the refusal it is (Slurm's clients absent here before `make
    # slurm` installs them, present after: either way the partition is named)
    with pytest.raises(PlaceError, match="slurm's default partition: (sinfo did not answer"
                                         "|Slurm's clients .* are not on this machine)"):
        SlurmPlace(stage).run_ranks(RankJob("x", lambda n: [], lambda n: {}, 1))
    stage = Stage("03_kernel_test", registry.resolve("03_kernel_test", {"context": "kube"}),
                  tmp_path, Door(tmp_path, "03_kernel_test"), None)
    with pytest.raises(Unsupported, match="no image given"):  # nothing applied without one
        KubePlace(stage).run_ranks(RankJob("x", lambda n: [], lambda n: {}, 1))
    node = NodeRank(1, 2, "leader", 29500)
    assert (node.rank, node.nodes, node.master_addr, node.port) == (1, 2, "leader", 29500)


def test_papermill_plans_04_for_two_nodes_touching_no_cluster(tmp_path):
    """The issue's own command: `papermill notebooks/04_serve.ipynb out.ipynb -p context plan
    -p nodes 2` exits 0; the StatefulSet it renders passes kubernetes-validate --strict and holds
    DP 16 with start ranks 0 and 8, a leader-only HTTP Service, requests equal to limits, and the
    HF token only as a Secret reference; the LeaderWorkerSet rendering beside it."""
    import subprocess
    import sys

    import yaml

    from lib.core.door import REPO_ROOT

    results = tmp_path / "results"
    for workload in ("statefulset", "leaderworkerset"):
        done = subprocess.run(
            [sys.executable, "-m", "papermill", str(REPO_ROOT / "notebooks" / "04_serve.ipynb"),
             str(tmp_path / f"{workload}.ipynb"), "--cwd", str(REPO_ROOT / "notebooks"),
             "-p", "context", "plan", "-p", "nodes", "2", "-p", "results_dir", str(results),
             "-p", "run_id", workload, "-p", "kube_workload", workload,
             "-p", "hf_token_secret", "hf-token"],
            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    objects = list(yaml.safe_load_all(
        (results / "statefulset" / "04_serve" / "manifests" / "vllm.yaml").read_text()))
    kinds = {o["kind"]: o for o in objects}
    script = kinds["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]["command"][2]
    assert script.count("--data-parallel-size 16") == 2
    assert "--data-parallel-start-rank 0" in script and "--data-parallel-start-rank 8" in script
    http = [o for o in objects if o["kind"] == "Service" and o["spec"].get("type") == "ClusterIP"]
    assert http[0]["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == "vllm-0"
    container = kinds["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"] == container["resources"]["limits"]
    token = [e for e in container["env"] if e["name"] == "HF_TOKEN"]
    assert token[0]["valueFrom"]["secretKeyRef"]["name"] == "hf-token" and "value" not in token[0]
    gates = json.loads((results / "statefulset" / "04_serve" / "gates.json").read_text())
    assert {g["gate"]: g["status"] for g in gates}[
        "vllm: manifests valid (kubernetes-validate --strict 1.36)"] == "PASS"
    lws = (results / "leaderworkerset" / "04_serve" / "manifests" / "vllm.yaml").read_text()
    assert "kind: LeaderWorkerSet" in lws


def test_the_whole_guide_plans_for_kube_through_the_runner(tmp_path, monkeypatch):
    """`python -m lib.runner run --context plan`: every stage that acts through its place plans
    (objects rendered, checked, commands recorded), none FAILs, nothing touches a cluster."""
    from lib import runner

    monkeypatch.setattr(runner, "RESULTS", tmp_path)
    stages = ["00_cluster", "02_image", "03_kernel_test", "04_serve", "05_sweep", "06_multicomm"]
    run_dir, rc = runner.run_guide("plan", "plan-1", {"test_ep_tokens": "128",
                                                      "results_dir": str(tmp_path)}, stages)
    assert rc == 0
    for stage, name in (("00_cluster", "node-probes"), ("03_kernel_test", "test-ep-at-128-tokens"),
                        ("04_serve", "vllm"), ("05_sweep", "vllm"),
                        ("06_multicomm", "vllm-epnc1-1")):
        assert (run_dir / stage / "manifests" / f"{name}.yaml").exists(), (stage, name)
        gates = json.loads((run_dir / stage / "gates.json").read_text())
        assert not [g for g in gates if g["status"] == "FAIL"], stage
        assert any(g["gate"].startswith(f"{name}: manifests valid") and g["status"] == "PASS"
                   for g in gates), (stage, [g["gate"] for g in gates])
    calls = read_transcript(run_dir / "transcript.jsonl")
    ran = {e["key"][0].rsplit("/", 1)[-1] for e in calls if e["kind"] == "run"
           and e["stage"] != "_run"}
    assert ran <= {"kubernetes-validate", "shellcheck", "hadolint", "git"}, ran
    # 02 plans the image's verify script as a pod on a node
    assert (run_dir / "02_image" / "manifests" / "verify-image.yaml").exists()


def test_long_object_names_that_differ_at_the_end_stay_distinct():
    """05's backend A/B on kube names its AIPerf Jobs `aiperf-<engine>-<backend>-<shape>-c<C>-r<R>`:
    cut to 40 characters, every repeat's Job of a cell had one name and the second was refused as
    already recorded. A long slug keeps its head and a digest of the whole."""
    from lib.places.kube.pods import object_name
    from lib.places.kube.manifests import NAME_MAX, NAME_RULE

    names = {object_name(f"aiperf-vllm-allgather-reducescatter-decode-c{c}-r{r}")
             for c in (1, 32) for r in (1, 2, 3)}
    assert len(names) == 6
    assert all(len(n) == NAME_MAX and NAME_RULE.match(n) for n in names)
    assert all(n.startswith("aiperf-vllm-allgather-reducesca-") for n in names)
    assert object_name("test_ep at 128 tokens") == "test-ep-at-128-tokens"  # short: unchanged
    # whatever it is given, a valid name (a Service's must begin with a letter)
    for what in ("05_sweep.log", "8 arms", "", "-", "x" * 80, "9" * 80):
        name = object_name(what)
        assert len(name) <= NAME_MAX and NAME_RULE.match(name), (what, name)


# ---- what a place is handed: typed values, never a parameter by its name -----------------------
PLACES_DIR = Path(__file__).resolve().parents[1] / "lib" / "places"


def parameter_reads(path: Path) -> list[str]:
    """Where a module reads a parameter by its name: `<x>.params` (the stage's parameters as a
    bag), or a parameter's name as the key of a subscript or a `.get` on a stage, its params, or
    values resolved from them."""
    import ast

    names = set(registry.PARAMS)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "params":
            found.append(f"{path.name}:{node.lineno} .params")
        key, subject = None, None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key, subject = node.slice.value, node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant)):
            key, subject = node.args[0].value, node.func.value
        if key in names and subject is not None:
            said = ast.unparse(subject)
            if said in ("p", "values", "given") or any(
                    w in said for w in ("stage", "params", "resolved")):
                found.append(f"{path.name}:{node.lineno} {said}[{key!r}]")
    return found


def test_no_place_module_reads_a_parameter_by_its_name_or_checks_one():
    """lib/places takes the values its stage hands it (lib.places.base.PlaceSpec and the typed
    specs): no parameter is read by its name, and none is refused there (the stage's model
    refused it before any effect: lib.stages.registry, lib.stages.rules_places)."""
    modules = sorted(PLACES_DIR.rglob("*.py"))
    assert len(modules) > 20
    assert [r for m in modules for r in parameter_reads(m)] == []
    assert [m.name for m in modules if "raise ParameterError" in m.read_text()] == []
    assert [m.name for m in modules if "ParameterError" in m.read_text()] == []


def test_the_parameter_read_check_finds_a_read_by_name(tmp_path):
    """The FAIL path of the check above, on the forms a read took."""
    place = tmp_path / "place.py"
    place.write_text("def f(self, stage, p, pod):\n"
                     "    a = self.stage['image']\n"
                     "    b = stage.params.get('context')\n"
                     "    c = p.get('engine')\n"
                     "    d = pod.get('image')  # a pod's JSON: not a parameter\n")
    assert sorted(parameter_reads(place)) == [
        "place.py:2 self.stage['image']", "place.py:3 .params",
        "place.py:3 stage.params['context']", "place.py:4 p['engine']"]


def test_a_stage_hands_its_place_the_spec_built_once_from_its_model(tmp_path):
    """open_stage attaches the PlaceSpec built from the stage's typed model; the place reads
    its attributes; a replay builds it from the recorded parameters the same way; a Stage made
    without the opener builds the same spec on first use."""
    from lib.places.base import PlaceSpec
    from lib.stages import specs

    ns = {"context": "plan", "results_dir": str(tmp_path), "run_id": "p3", "nodes": 4,
          "kube_workload": "leaderworkerset", "model_cache_dir": "/mnt/nvme/hf-cache"}
    stage = open_stage("04_serve", ns)
    spec = stage.place_spec
    assert isinstance(spec, PlaceSpec) and spec == specs.place_spec(stage.params)
    assert (spec.context, spec.plan_for, spec.nodes, spec.gpus_per_node, spec.engine) == (
        "plan", "kube", 4, 8, "vllm")
    assert spec.leaderworkerset and spec.model_cache_dir == "/mnt/nvme/hf-cache"
    place = places.for_stage(stage)
    assert place.spec is spec and type(place) is KubePlace and place.namespace == spec.namespace
    assert place.plans_only and place.planned is not None
    # the recorded parameters (params.json, a dict) give the same spec
    recorded = json.loads((tmp_path / "p3" / "04_serve" / "params.json").read_text())
    assert specs.place_spec(recorded) == spec == specs.place_spec_of(stage.params.as_dict())
    made = Stage("04_serve", stage.params, tmp_path / "p3", Door(tmp_path / "p3", "04_serve"),
                 None)
    assert made.place_spec == spec
    # a stage that does not take a parameter hands None for it
    roots = specs.place_spec(registry.resolve("01_public_roots", {}))
    assert roots.image is None and roots.model is None and roots.context == "local"
    with pytest.raises(Exception):  # frozen: a place cannot change what it was handed
        spec.nodes = 1  # type: ignore[misc]
