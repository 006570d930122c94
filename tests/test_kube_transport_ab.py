"""03's transport A/B on the real control plane (tests/kubeplane.py; nodes simulated by the
kubelet double, test_ep's logs composed from the 2x H200 recording, tests/compose.py): each
arm's test_ep a job of its own over its own contract, the arms interleaved, the ratio gated;
a run whose node exits 1 FAILs the ratio naming it; nothing left behind; the stage replays."""
from __future__ import annotations

import json

import pytest
import yaml

try:
    from kubeplane import NOT_BUILT, plane_available
except ImportError:
    from tests.kubeplane import NOT_BUILT, plane_available

from lib.places.kube.pods import object_name
from lib.stages import kernel, transport_ab
from tests import compose
from tests.kube_env import KubeEnv

pytestmark = pytest.mark.skipif(not plane_available(), reason=NOT_BUILT)

AB = {"test_ep_tokens": "128", "transport_ab": "true", "pin_set": "newest-2026-12",
      "ab_repeats": "2"}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with KubeEnv(tmp_path_factory.mktemp("kube-transport-ab")) as cluster_env:
        yield cluster_env


def job_of(transport: str, repeat: int) -> str:
    return object_name(f"test_ep at 128 tokens, {transport_ab.LABELS[transport]}, repeat {repeat}")


def script_runs(env, logs, failing: tuple[str, int] | None = None) -> None:
    for repeat, transport in transport_ab.arm_order(2):
        codes = [0, 1] if failing == (transport, repeat) else None
        gin_type = 5 if transport == "gin_type5" else None  # NCCL's assignment line, type 5
        env.ranks(job_of(transport, repeat), compose.compose_test_ep(logs / transport,
                                                                     gin_type=gin_type),
                  exit_codes=codes)


def test_03_ab_runs_each_arm_over_its_contract_interleaved_and_gates_the_ratio(env, tmp_path):
    script_runs(env, tmp_path / "logs")
    run = tmp_path / "run"
    stage = env.stage("03_kernel_test", run, **AB)
    data = kernel.run(stage)
    kernel.show(stage, data)
    stage.finish()
    failed = [(g.gate, g.reason) for g in stage.gates if g.status == "FAIL"]
    assert failed == []
    manifests = run / "03_kernel_test" / "manifests"
    for repeat, transport in transport_ab.arm_order(2):
        objects = list(yaml.safe_load_all((manifests / f"{job_of(transport, repeat)}.yaml")
                                          .read_text()))
        for pod in [o for o in objects if o["kind"] == "Pod"]:
            env_set = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
            assert env_set["NCCL_GIN_TYPE"] == ("5" if transport == "gin_type5" else "2")
        gate = f"test_ep 128 tokens, {transport_ab.LABELS[transport]}, repeat {repeat}: " \
               "EFA provider selected on every rank"
        assert gate in {g.gate: g.status for g in stage.gates if g.status == "PASS"}
        loaded = f"test_ep 128 tokens, {transport_ab.LABELS[transport]}, repeat {repeat}: " \
                 "GIN type 5 loaded on every rank"
        assert (loaded in {g.gate for g in stage.gates if g.status == "PASS"}) == (
            transport == "gin_type5")
    # the order the jobs were applied in: type 2 first, then type 5 first on repeat 2
    applied = [e["key"] for e in map(json.loads, (run / "transcript.jsonl").read_text()
                                     .splitlines()) if e["kind"] == "run"
               and "apply" in e["key"]]
    names = [next(a for a in key if a.endswith(".yaml")).rsplit("/", 1)[1][:-5]
             for key in applied]
    assert names == [job_of(t, r) for r, t in transport_ab.arm_order(2)]
    # both arms ran the same composed logs here: a ratio of exactly 1, no spread (the control
    # plane measures nothing; tests/test_transport_ab.py checks the ratio of differing arms)
    (ratio,) = [g for g in stage.gates if g.gate.endswith("ratio type 5 / type 2 with its "
                                                          "interval")]
    assert ratio.status == "PASS" and ratio.observed == [1.0, 1.0, 1.0]
    assert ratio.reason.startswith("no difference between type 2 and GIN type 5 resolved")
    (row,) = json.loads((run / "03_kernel_test" / "transport_ab.json").read_text())
    assert [(r["repeat"], r["transport"]) for r in row["runs"]] == transport_ab.arm_order(2)
    assert env.objects_left() == []
    replay = env.stage("03_kernel_test", run, replay=True, **AB)
    kernel.run(replay)
    replay.finish()


def test_03_ab_with_a_run_whose_node_failed_fails_the_ratio_naming_that_run(env, tmp_path):
    script_runs(env, tmp_path / "logs", failing=("gin_type5", 2))
    run = tmp_path / "run"
    stage = env.stage("03_kernel_test", run, **AB)
    kernel.run(stage)
    stage.finish()
    failed = {g.gate: g for g in stage.gates if g.status == "FAIL"}
    exit_gate = "test_ep 128 tokens, GIN type 5, repeat 2: test_ep exit code 0"
    assert exit_gate in failed, list(failed)
    ratio = failed["test_ep 128 tokens: D+C p50 ratio type 5 / type 2 with its interval"]
    assert ratio.observed == "3 of 4 runs measured"
    assert ratio.reason.endswith("(GIN type 5 repeat 2)")
    assert not [g for g in failed if "GIN type 2" in g or "repeat 1" in g]
    assert env.objects_left() == []
