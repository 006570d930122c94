"""The composed cluster logs (tests/compose.py) against the project's real assertions: a
composed run that is right passes them, each variant fails the one gate it is made to fail,
naming the rank; the AIPerf Job's log gives its files back.
"""
import json
from pathlib import Path

import pytest

from lib.engines.vllm_logs import assert_backend, efa_provider_per_rank, per_rank_nccl
from lib.measure.aiperf import read_exports
from lib.measure.testep import GATE_EFA, GATE_EXIT, GATE_RANKS, gates_from_test_ep
from lib.measure.triage import read_log
from lib.places.stream import unpack
from tests import compose

BACKEND_GATES = ("vllm_all2all_manager", "vllm_ep_split", "vllm_prepare_finalize",
                 "vllm_api_servers_ready", "vllm_no_fallback_no_legacy_buffer")


def joined(paths):
    return "".join(read_log(p) for p in paths)


def by_name(gates):
    return {g["gate"]: g for g in gates}


def all_composed(paths, tmp_path):
    for p in paths:
        assert p.name.startswith("composed-") and p.parent == tmp_path and p.is_file()


# --- test_ep on 2 nodes x 8 ranks ---------------------------------------------------------------
@pytest.mark.parametrize("form", compose.PROVIDER_FORMS)
def test_16_rank_test_ep_passes_the_kernel_gates(tmp_path, form):
    paths = compose.compose_test_ep(tmp_path, provider_form=form)
    all_composed(paths, tmp_path)
    assert [p.name for p in paths] == ["composed-test_ep-16ranks-efa-node0.log",
                                       "composed-test_ep-16ranks-efa-node1.log"]
    text = joined(paths)
    provider = ("Selected provider is efa, fabric is efa-direct (found 16 nics)" if form == "1.21"
                else "Selected Provider is efa (found 16 nics)")
    assert text.count(provider) == 16 and text.count("NCCL INFO Using network Libfabric") == 16
    gates = gates_from_test_ep(text, [0, 0], num_ranks=16, evidence=[p.name for p in paths],
                               transport="efa")
    assert {g["gate"]: g["status"] for g in gates} == dict.fromkeys(
        [g["gate"] for g in gates], "PASS"), [g["reason"] for g in gates]
    assert by_name(gates)[GATE_RANKS]["observed"]["ranks_seen"] == list(range(16))
    assert by_name(gates)[GATE_EFA]["observed"]["per_rank"] == {str(r): 1 for r in range(16)}


def test_a_rank_without_its_provider_line_fails_the_efa_gate_by_name(tmp_path):
    paths = compose.compose_test_ep(tmp_path, drop_provider_rank=13)
    all_composed(paths, tmp_path)
    gates = by_name(gates_from_test_ep(joined(paths), [0, 0], num_ranks=16,
                                       evidence=["composed"], transport="efa"))
    efa = gates[GATE_EFA]
    assert efa["status"] == "FAIL"
    assert "no EFA provider line from rank(s) 13 of 16" in efa["reason"]
    assert all(g["status"] == "PASS" for name, g in gates.items() if name != GATE_EFA)
    # one node's log is not enough: the other node's eight ranks are named
    one = efa_provider_per_rank(read_log(paths[0]), 16)
    assert one["status"] == "FAIL" and "rank(s) 8, 9, 10, 11, 12, 13, 14, 15 of 16" in one["reason"]


def test_the_failed_run_fails_the_exit_and_rank_gates(tmp_path):
    paths = compose.compose_test_ep_failure(tmp_path, dead_rank=11)
    all_composed(paths, tmp_path)
    gates = by_name(gates_from_test_ep(joined(paths), {"node0": 1, "node1": 1}, num_ranks=16,
                                       evidence=["composed"], transport="efa"))
    assert gates[GATE_EXIT]["status"] == "FAIL"
    assert gates[GATE_RANKS]["status"] == "FAIL" and "lacks combine" in gates[GATE_RANKS]["reason"]
    assert gates[GATE_EFA]["status"] == "PASS"
    text = joined(paths)
    assert text.count("DeepEP Gin barrier timeout, tag: 8,") == 15
    assert text.count("[rank11]: torch.AcceleratorError: CUDA error: an illegal memory") == 1


# --- vLLM DP16: a leader and a headless worker --------------------------------------------------
def test_dp16_pods_pass_the_backend_and_per_rank_gates(tmp_path):
    leader, worker = compose.compose_vllm_pods(tmp_path)
    all_composed([leader, worker], tmp_path)
    assert (leader.name, worker.name) == ("composed-vllm-dp16-deepep_v2-leader.log",
                                          "composed-vllm-dp16-deepep_v2-worker1.log")
    lead, work = read_log(leader), read_log(worker)
    gates = by_name(assert_backend(lead, "deepep_v2", dp_size=16, num_experts=128,
                                   log_name=leader.name, api_servers=8))
    assert {k: g["status"] for k, g in gates.items()} == dict.fromkeys(BACKEND_GATES, "PASS"), \
        [g["reason"] for g in gates.values()]
    assert gates["vllm_ep_split"]["observed"] == {"ep_rank": 0, "ep_size": 16,
                                                  "local_experts": 8, "global_experts": 128}
    assert "[EP Rank 0/16]" in lead and "Local/global number of experts: 8/128" in lead
    assert lead.count("Using DeepEPV2All2AllManager all2all manager.") == 1
    # the rank-0-only lines and the API servers are the leader's: the headless worker has none
    for absent in ("EP Rank", "all2all manager", "Application startup complete", "ApiServer_"):
        assert absent not in work, absent
    assert "'headless': True" in work and "in headless mode" in work
    both = lead + work
    assert efa_provider_per_rank(both, 16)["status"] == "PASS"
    assert per_rank_nccl(both, 16)["status"] == "PASS"
    assert efa_provider_per_rank(lead, 16)["status"] == "FAIL"  # one pod is half the ranks


def test_dp16_cluster_serve_gates_patch_0002s_timeouts_on_every_rank_of_the_image(tmp_path):
    """On a cluster the guide's image applies patch 0002 (Layer 7b): the serve's gates ask
    every rank's line; an image without it (no line), a rank without it or with DeepEP's own
    defaults FAIL naming the rank(s). The composed line is the patch's own print."""
    from lib.engines import vllm_logs
    from lib.places.cluster import serve_gates, settings_gates

    patch = (Path(__file__).resolve().parents[1] / "patches"
             / "0002-vllm-deepep-v2-elastic-buffer-timeouts.patch").read_text()
    for piece in ('f"[guide-0002] DeepEPV2All2AllManager rank {self.rank}/{self.world_size}: "',
                  "f\"ElasticBuffer num_gpu_timeout_secs={self._timeouts['num_gpu_timeout_secs']} \"",
                  "f\"num_cpu_timeout_secs={self._timeouts['num_cpu_timeout_secs']} \"",
                  'f"allow_hybrid_mode={envs.VLLM_DEEPEP_V2_ALLOW_HYBRID_MODE}"'):
        assert piece in patch, piece
    assert vllm_logs._TIMEOUTS_RE.search(compose.TIMEOUTS_LINE.format(
        rank=0, world=16, gpu=600, cpu=600, hybrid=True)).group(5) == "True"

    def timeouts(gate: str = "timeouts", mode: str = "hybrid", **variant):
        logs = {p.name: read_log(p) for p in compose.compose_vllm_pods(tmp_path / str(variant),
                                                                       **variant)}
        leader = next(text for name, text in logs.items() if name.endswith("leader.log"))
        backend = serve_gates("vllm", leader, logs, backend="deepep_v2", nodes=2,
                              gpus_per_node=8, num_experts=128, enforce_eager=True,
                              api_servers=8, log_name="leader.log", evidence=sorted(logs))
        # beside the backend gates, not among them: the serve is still deepep_v2 without it
        assert "elastic_buffer_timeouts_per_rank" not in by_name(backend)
        got = by_name(settings_gates("vllm", logs, backend="deepep_v2", nodes=2,
                                     gpus_per_node=8, evidence=sorted(logs),
                                     deepep_v2_mode=mode))
        assert set(got) == {"elastic_buffer_timeouts_per_rank", "deepep_v2_mode_per_rank"}
        return got["elastic_buffer_timeouts_per_rank"] if gate == "timeouts" else got[
            "deepep_v2_mode_per_rank"]

    ok = timeouts()
    assert ok["status"] == "PASS" and ok["observed"]["ranks"] == list(range(16))
    # the DeepEP-V2 mode each rank passed ElasticBuffer, from the same line
    ran = timeouts(gate="mode")
    assert ran["status"] == "PASS" and ran["observed"] == {"ranks": list(range(16)),
                                                           "allow_hybrid_mode": ["True"]}
    direct = timeouts(gate="mode", mode="direct")
    assert direct["status"] == "FAIL" and direct["reason"].startswith(
        "rank(s) 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15 passed ElasticBuffer "
        "allow_hybrid_mode=True: not the direct mode the serve was given")
    assert timeouts(gate="mode", mode="direct", allow_hybrid_mode=False)["status"] == "PASS"
    unsaid = timeouts(gate="mode", drop_timeouts_rank=3)
    assert unsaid["status"] == "FAIL" and "from rank(s) 3 of 16" in unsaid["reason"]
    bare = timeouts(elastic_timeouts=None)
    assert bare["status"] == "FAIL" and bare["observed"]["missing"] == list(range(16))
    one = timeouts(drop_timeouts_rank=11)
    assert one["status"] == "FAIL" and "rank(s) 11 of 16" in one["reason"]
    low = timeouts(elastic_timeouts=(100, 300))
    assert low["status"] == "FAIL" and "other timeouts than GPU 600 s / CPU 600 s" in low["reason"]


def test_dp16_with_one_api_server(tmp_path):
    leader, _ = compose.compose_vllm_pods(tmp_path, api_server_count=1, tag="-1api")
    text = read_log(leader)
    assert text.count("Application startup complete.") == 1
    gates = by_name(assert_backend(text, "deepep_v2", dp_size=16, num_experts=128,
                                   log_name=leader.name, api_servers=1))
    assert all(g["status"] == "PASS" for g in gates.values())


def test_a_worker_rank_without_its_provider_line_fails_naming_it(tmp_path):
    leader, worker = compose.compose_vllm_pods(tmp_path, drop_provider_rank=13,
                                               tag="-no-provider-rank13")
    g = efa_provider_per_rank(read_log(leader) + read_log(worker), 16)
    assert g["status"] == "FAIL"
    assert "no EFA provider line from rank(s) 13 of 16" in g["reason"]
    assert per_rank_nccl(read_log(leader) + read_log(worker), 16)["status"] == "PASS"


def test_a_legacy_deepep_backend_fails_the_no_legacy_gate(tmp_path):
    """vLLM's own lines when it builds a legacy DeepEP backend (the manager and prepare/finalize
    classes on deep_ep.Buffer), checked as a deepep_v2 serve."""
    leader, _ = compose.compose_vllm_pods(tmp_path, backend="deepep_high_throughput")
    assert leader.name == "composed-vllm-dp16-deepep_high_throughput-leader.log"
    gates = by_name(assert_backend(read_log(leader), "deepep_v2", dp_size=16, num_experts=128,
                                   log_name=leader.name, api_servers=8))
    legacy = gates["vllm_no_fallback_no_legacy_buffer"]
    assert legacy["status"] == "FAIL"
    assert legacy["observed"]["legacy_buffer_lines"] == 2
    assert any("DeepEPHTAll2AllManager" in e for e in legacy["evidence"])
    assert gates["vllm_all2all_manager"]["status"] == "FAIL"


def test_the_sitecustomize_trap_line_fails_the_no_legacy_gate(tmp_path):
    _, worker = compose.compose_vllm_pods(tmp_path, sitecustomize_legacy_rank=13,
                                          tag="-sitecustomize-rank13")
    text = read_log(worker)
    assert compose.SITECUSTOMIZE_LEGACY_LINE in text
    gates = by_name(assert_backend(text, "deepep_v2", dp_size=16, num_experts=128,
                                   log_name=worker.name, api_servers=0))
    assert gates["vllm_no_fallback_no_legacy_buffer"]["status"] == "FAIL"


# --- node probes --------------------------------------------------------------------------------
def test_node_probe_default_format_is_a_placeholder_of_key_value_lines(tmp_path):
    path = compose.compose_node_probe(tmp_path)
    assert path.name == "composed-node-probe-node-0.txt"
    lines = read_log(path).splitlines()
    assert lines[0] == "gdrdrv_version=2.5.1"
    assert lines[1:17] == [f"efa_device={d}" for d in compose.P5EN_EFA_DEVICES]
    assert lines[1] == "efa_device=rdmap86s0" and len(compose.P5EN_EFA_DEVICES) == 16
    assert lines[17:] == ["hugepages_total=4096", "hugepage_size_kib=2048"]
    old = read_log(compose.compose_node_probe(tmp_path, "composed-node-1", gdrdrv_version=None,
                                              efa_devices=(), hugepages_total=0))
    assert "gdrdrv_version" not in old and "efa_device" not in old
    assert "hugepages_total=0" in old


def test_node_probe_takes_another_format(tmp_path):
    """The probe's own format is defined elsewhere (lib/places/kube/manifests/probe.py): any formatter of
    the facts plugs in."""
    path = compose.compose_node_probe(tmp_path, formatter=lambda f: json.dumps(dict(f)) + "\n",
                                      gdrdrv_version="2.4")
    facts = json.loads(read_log(path))
    assert facts["gdrdrv_version"] == "2.4" and len(facts["efa_devices"]) == 16
    assert set(facts) == {"node", "gdrdrv_version", "efa_devices", "hugepages_total",
                          "hugepage_size_kib"}


# --- an AIPerf Job's log ------------------------------------------------------------------------
def test_an_aiperf_jobs_log_gives_its_cell_back(tmp_path):
    path = compose.compose_aiperf_job_log(tmp_path / "logs", block="aiperf-c1")
    assert path.name == "composed-aiperf-job-concurrency_1.log"
    text = read_log(path)
    assert text.index("NVIDIA AIPerf | LLM Metrics") < text.index(
        "=== guide-artifacts begin aiperf-c1 ===")
    got = unpack(text, "aiperf-c1", tmp_path / "c1")
    names = {p.relative_to(tmp_path / "c1").as_posix() for p in got}
    assert {"profile_export_aiperf.json", "phases/profiling/profile_export_aiperf.json",
            "run_config.json", "logs/aiperf.log"} <= names
    row = read_exports(tmp_path / "c1").iloc[0]
    recorded = read_exports(compose.AIPERF_SWEEP / "concurrency_1").iloc[0]
    for column in ("concurrency", "requests_requested", "requests_completed", "errors",
                   "output_tps", "ttft_p50_ms", "aiperf_version"):
        assert row[column] == recorded[column], column
    assert row["concurrency"] == 1 and row["requests_completed"] == 40
