"""05's backend A/B on the real control plane with exactly two p5en nodes (tests/kube_env.py:
8 GPUs allocatable each, the kubelet double playing them). Each arm's serve asks for every GPU
of both nodes, so the two arms cannot be up at once: on a cluster place lib.stages.ab serves
them one at a time, each StatefulSet made whole for its block of cells and deleted before the
next arm's is applied (06's rounds; at two repeats the blocks' order reverses, as
tests/test_kube_stages.py's 06 test shows for two DeepEP arms). Side by side, the second arm's pods would stay
Pending (Insufficient nvidia.com/gpu) until schedule_timeout_s.
"""
from __future__ import annotations

from pathlib import Path

import pytest

try:
    from kubeplane import NOT_BUILT, plane_available
except ImportError:
    from tests.kubeplane import NOT_BUILT, plane_available

from lib.core.door import read_transcript
from lib.places.kube.pods import object_name
from lib.stages import serve as serve_stage
from lib.stages import sweep as sweep_stage
from tests import compose
from tests.kube_env import MODEL_CACHE, NODES, RECORDED_RUN, KubeEnv, model_config

pytestmark = pytest.mark.skipif(not plane_available(), reason=NOT_BUILT)
ARMS = {"allgather_reducescatter": "vllm-allgather-reducescatter", "deepep_v2": "vllm-deepep-v2"}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with KubeEnv(tmp_path_factory.mktemp("kube")) as cluster_env:
        yield cluster_env


def test_05_backend_ab_on_two_p5en_nodes_serves_the_arms_one_at_a_time(env, tmp_path):
    assert len(NODES) == 2 and all(n.startswith("p5en") for n in NODES)
    p = env.stage("04_serve", tmp_path / "probe").params
    config = model_config(RECORDED_RUN / "model_config.json", experts=128, top_k=8)

    def pods(name: str, backend: str, reads: int = 0) -> None:
        env.serve(name, compose.compose_vllm_pods(tmp_path / f"logs-{name}", backend=backend),
                  model=p["model"], revision=p["model_revision"], config=config,
                  metrics_reads=reads)

    # allgather's block, then deepep's (two shapes a block: 4 /metrics reads each). One
    # repeat: at two, the second round's AIPerf Job of the allgather arm would be named as the
    # first (the kube place cuts Job names at 40 characters, "aiperf-vllm-allgather-
    # reducescatter-deco"), and its manifest, already recorded, is refused (EvidenceError)
    pods("vllm", "deepep_v2")
    pods(f"{ARMS['allgather_reducescatter']}-1", "allgather_reducescatter", 4)
    pods(f"{ARMS['deepep_v2']}-1", "deepep_v2", 4)
    cells = [f"{slug}-{shape}" for slug in ARMS.values() for shape in ("decode", "prefill")]
    # the Jobs' names as the place cuts them (lib.places.kube.pods.object_name): at 40
    # characters an arm's repeats share one name (a Job is deleted before the next is made)
    jobs = sorted({object_name(f"aiperf-{c}-c1-r1") for c in cells})
    env.aiperf_jobs(jobs, ["concurrency_1"] * len(jobs))
    run = tmp_path / "run"
    s04 = env.stage("04_serve", run, model_cache_dir=MODEL_CACHE)
    serve_stage.run(s04)
    s04.finish()
    stage = env.stage("05_sweep", run, model_cache_dir=MODEL_CACHE, concurrency="1", repeats=1,
                      request_count=40, requests_per_slot=0, warmup_requests=4,
                      warmup_full_batch=False, output_tokens=32, answer_prompts=0,
                      ab_backends="allgather_reducescatter,deepep_v2")
    data = sweep_stage.run(stage)
    stage.finish()
    failed = [(g.gate, g.reason) for g in stage.gates if g.status == "FAIL"]
    # every cell measured and gated PASS; at one repeat the ratios have no interval: their
    # gates FAIL saying so (and only they)
    assert sorted(failed) == [
        (f"output tok/s deepep_v2 / allgather_reducescatter at c1, {shape} with its interval",
         "only 1 paired repeat(s) measured") for shape in ("decode", "prefill")], failed
    assert [g.status for g in stage.gates if ": AIPerf exit 0" in g.gate] == ["PASS"] * 4
    assert data["layout"].startswith("allgather_reducescatter, deepep_v2 one at a time (each "
                                     "holds every GPU of its nodes)"), data["layout"]
    calls = [e["key"] for e in read_transcript(run / "transcript.jsonl")
             if e["stage"] == "05_sweep" and e["kind"] == "run" and e["key"][0] == "kubectl"]
    # every arm's StatefulSet applied only after the one before it was deleted
    served = []
    for key in calls:
        yaml = next((Path(a).stem for a in key if a.endswith(".yaml")), "")
        if "apply" in key and yaml.startswith("vllm-"):
            served.append(("apply", yaml))
        elif "delete" in key and any("vllm-" in a for a in key):
            served.append(("delete", next(a for a in key if "vllm-" in a)))
    applied = [name for verb, name in served if verb == "apply"]
    assert applied == [f"{ARMS['allgather_reducescatter']}-1", f"{ARMS['deepep_v2']}-1"], served
    up = 0
    for verb, _ in served:
        up += 1 if verb == "apply" else -1
        assert up <= 1, served  # never two arms' StatefulSets at once
    assert len(data["ratios"]) == 2  # deepep_v2 against allgather, decode and prefill
    assert env.objects_left() == []
