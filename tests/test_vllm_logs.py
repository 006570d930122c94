"""lib.vllm_logs against vLLM 0.24.0's real logs from two H200s, and real NCCL lines.

The vLLM logs are ../shared/fixtures/vllm-0.24.0-2xh200/ (TOOLCHAIN.md "vLLM 0.24.0 on two
H200s"). They hold no NCCL INFO line (those runs did not set NCCL_DEBUG), so the NCCL parsers are
tested on lines quoted verbatim from public NCCL / aws-ofi-nccl output, each with its source.
"""

from pathlib import Path

import pytest

from lib.engines.vllm_logs import (assert_backend, efa_provider_per_rank, nccl_comm_lines, nccl_version,
                           per_rank_nccl, rank0_pid, requested_in_log, startup_seconds)
from tests.test_serve_vllm import NOEP_LOG, RECORDED_06

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
LOGS = FIXTURES / "vllm-0.24.0-2xh200"
GATES = ("vllm_all2all_manager", "vllm_ep_split", "vllm_prepare_finalize",
         "vllm_api_servers_ready", "vllm_no_fallback_no_legacy_buffer")


def log(name: str) -> str:
    path = LOGS / f"vllm-{name}.log"
    # Missing evidence must fail the suite, never skip it.
    assert path.is_file(), f"fixture missing: {path}"
    return path.read_text()


def gates(name: str, requested: str, dp_size: int = 2, num_experts: int | None = 64) -> dict:
    out = assert_backend(log(name), requested, dp_size=dp_size, num_experts=num_experts,
                         log_name=f"vllm-{name}.log")
    assert [g["gate"] for g in out] == list(GATES)
    for g in out:
        assert set(g) == {"gate", "status", "observed", "expected", "reason", "evidence"}
        assert g["status"] in ("PASS", "FAIL", "SKIP") and g["reason"]
    return {g["gate"]: g for g in out}


@pytest.mark.parametrize("name", ["allgather_reducescatter", "allgather_reducescatter-run2"])
def test_allgather_logs_pass(name):
    g = gates(name, "allgather_reducescatter")
    assert {k: v["status"] for k, v in g.items()} == dict.fromkeys(GATES, "PASS")
    assert g["vllm_all2all_manager"]["observed"]["constructed"] == ["AgRsAll2AllManager"]
    assert g["vllm_ep_split"]["observed"] == {"ep_rank": 0, "ep_size": 2, "local_experts": 32,
                                              "global_experts": 64}
    assert g["vllm_prepare_finalize"]["observed"] == ["MoEPrepareAndFinalizeNaiveDPEPModular"]
    assert g["vllm_api_servers_ready"]["observed"]["startup_complete"] == 2


def test_deepep_v2_log_passes():
    g = gates("deepep_v2-run2", "deepep_v2")
    assert {k: v["status"] for k, v in g.items()} == dict.fromkeys(GATES, "PASS")
    m = g["vllm_all2all_manager"]
    assert m["observed"]["constructed"] == ["DeepEPV2All2AllManager"]
    assert m["evidence"] == [
        "vllm-deepep_v2-run2.log:52: (Worker pid=3397) INFO 11-30 09:57:11 "
        "[cuda_communicator.py:185] Using DeepEPV2All2AllManager all2all manager."]
    assert g["vllm_prepare_finalize"]["observed"] == ["DeepEPV2PrepareAndFinalize"]


def test_rank0_only_lines_say_so():
    g = gates("deepep_v2-run2", "deepep_v2")
    for name in ("vllm_all2all_manager", "vllm_ep_split", "vllm_prepare_finalize"):
        assert "logged by rank 0 only" in g[name]["reason"]
    assert "rank 0" not in g["vllm_api_servers_ready"]["reason"]
    # The manager line comes from the worker vLLM assigns global rank 0.
    m = g["vllm_all2all_manager"]["observed"]
    assert m["logged_by_pid"] == [m["rank0_pid"]] == ["3397"]
    assert rank0_pid(log("deepep_v2-run2")) == "3397"


def test_naive_log_fails_with_the_fallback_line_as_evidence():
    g = gates("naive", "naive")
    m = g["vllm_all2all_manager"]
    assert m["status"] == "FAIL"
    assert m["observed"]["constructed"] == ["AgRsAll2AllManager"]
    assert m["observed"]["requested_in_log"] == "naive"
    warning = ("vllm-naive.log:13: WARNING 11-30 09:43:30 [parallel.py:450] The 'naive' all2all "
               "backend has been removed. Falling back to 'allgather_reducescatter'.")
    assert m["evidence"][0] == warning
    assert "'naive' was replaced by 'allgather_reducescatter'" in m["reason"]
    # The warning is logged by the main process and by each API server.
    assert m["observed"]["fallback_warnings"] == 3
    assert g["vllm_no_fallback_no_legacy_buffer"]["status"] == "FAIL"
    assert g["vllm_no_fallback_no_legacy_buffer"]["evidence"][0] == warning
    assert g["vllm_prepare_finalize"]["status"] == "FAIL"
    # What did run is visible and true: the split and the API servers.
    assert g["vllm_ep_split"]["status"] == "PASS"
    assert g["vllm_api_servers_ready"]["status"] == "PASS"


def test_allgather_log_checked_as_deepep_v2_fails():
    g = gates("allgather_reducescatter", "deepep_v2")
    m = g["vllm_all2all_manager"]
    assert m["status"] == "FAIL"
    assert m["expected"] == "DeepEPV2All2AllManager"
    assert "but vLLM built AgRsAll2AllManager" in m["reason"]
    assert "not from a run that asked for 'deepep_v2'" in m["reason"]
    assert g["vllm_prepare_finalize"]["status"] == "FAIL"
    assert g["vllm_prepare_finalize"]["expected"] == "DeepEPV2PrepareAndFinalize"


def test_deepep_log_checked_as_allgather_fails():
    g = gates("deepep_v2-run2", "allgather_reducescatter")
    assert g["vllm_all2all_manager"]["status"] == "FAIL"
    assert g["vllm_prepare_finalize"]["status"] == "FAIL"


def test_wrong_expert_count_fails():
    g = gates("deepep_v2-run2", "deepep_v2", num_experts=128)
    ep = g["vllm_ep_split"]
    assert ep["status"] == "FAIL"
    assert "global experts 64 != the model's 128" in ep["reason"]
    assert ep["evidence"][0].startswith("vllm-deepep_v2-run2.log:58: (Worker_DP0_EP0 pid=3397)")


def test_dp4_fails_split_and_api_servers():
    g = gates("allgather_reducescatter", "allgather_reducescatter", dp_size=4)
    assert g["vllm_ep_split"]["status"] == "FAIL"
    assert "EP size 2 != dp_size 4" in g["vllm_ep_split"]["reason"]
    assert g["vllm_api_servers_ready"]["status"] == "FAIL"
    assert g["vllm_api_servers_ready"]["observed"]["startup_complete"] == 2
    assert g["vllm_api_servers_ready"]["expected"] == 4


def test_expert_count_optional():
    g = gates("deepep_v2-run2", "deepep_v2", num_experts=None)
    assert g["vllm_ep_split"]["status"] == "PASS"
    assert "expert count was not given" in g["vllm_ep_split"]["reason"]


def test_deepep_ht_request_against_allgather_log():
    # A backend whose manager name comes from vLLM's source, not a 0.24.0 log.
    g = gates("allgather_reducescatter", "deepep_high_throughput")
    assert g["vllm_all2all_manager"]["status"] == "FAIL"
    assert g["vllm_all2all_manager"]["expected"] == "DeepEPHTAll2AllManager"
    assert g["vllm_no_fallback_no_legacy_buffer"]["status"] == "SKIP"


def test_unknown_backend_fails_saying_unknown():
    g = gates("allgather_reducescatter", "some_future_backend")
    assert g["vllm_all2all_manager"]["status"] == "FAIL"
    assert g["vllm_all2all_manager"]["reason"].startswith("unknown")


def test_a_log_without_rank0_lines_fails_each_rank0_gate():
    # A worker's log on a cluster carries none of rank 0's lines: keep only the API servers'
    # lines of the real log, as a stand-in that holds no worker line.
    text = "\n".join(l for l in log("deepep_v2-run2").splitlines() if "ApiServer" in l)
    g = {x["gate"]: x for x in assert_backend(text, "deepep_v2", dp_size=2, num_experts=64,
                                              log_name="api-only")}
    for name in ("vllm_all2all_manager", "vllm_ep_split", "vllm_prepare_finalize"):
        assert g[name]["status"] == "FAIL" and "logged by rank 0 only" in g[name]["reason"]


def test_requested_in_log_and_nccl_version():
    assert requested_in_log(log("naive")) == "naive"
    assert requested_in_log(log("deepep_v2-run2")) == "deepep_v2"
    # Absent from the non-default args = vLLM's default.
    assert requested_in_log(log("allgather_reducescatter")) == "allgather_reducescatter"
    assert requested_in_log("no vLLM here") is None
    assert nccl_version(log("allgather_reducescatter")) == "2.28.9"
    assert nccl_version(log("deepep_v2-run2")) == "2.30.4"  # the NCCL preload in effect


def test_startup_seconds_from_the_logs_timestamps():
    # First vLLM line -> last timestamped line before the last "Application startup complete.".
    assert startup_seconds(log("allgather_reducescatter")) == 75.0    # 09:41:41 -> 09:42:56
    assert startup_seconds(log("allgather_reducescatter-run2")) == 57.0
    assert startup_seconds(log("deepep_v2-run2")) == 93.0              # 09:55:59 -> 09:57:32
    assert startup_seconds(log("naive")) == 58.0
    assert startup_seconds("INFO:     Application startup complete.") is None


def test_the_real_logs_hold_no_nccl_info_lines():
    for name in ("allgather_reducescatter", "allgather_reducescatter-run2", "deepep_v2-run2",
                 "naive"):
        text = log(name)
        assert "NCCL INFO" not in text
        g = per_rank_nccl(text, 2)
        assert g["status"] == "FAIL" and "no NCCL INFO lines at all" in g["reason"]
        assert g["observed"]["missing"] == [0, 1]


# --- NCCL lines quoted verbatim from public sources ----------------------------------------------
# NCCL 2.2x, torchrun on two A100s: complete init of a 2-rank communicator. Source: a public README
# of a facebookresearch/lingua fork (code index id 12972285982).
TWO_RANKS_COMPLETE = """\
node0:23441:23666 [1] NCCL INFO TUNER/Plugin: Failed to find ncclTunerPlugin_v2, using internal tuner instead.
node0:23440:23664 [0] NCCL INFO TUNER/Plugin: Failed to find ncclTunerPlugin_v2, using internal tuner instead.
node0:23441:23666 [1] NCCL INFO ncclCommInitRank comm 0x55d761db2df0 rank 1 nranks 2 cudaDev 1 nvmlDev 1 busId 16000 commId 0xb3609cbb6ba7a88a - Init COMPLETE
node0:23440:23664 [0] NCCL INFO ncclCommInitRank comm 0x563d5b2b3360 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 10000 commId 0xb3609cbb6ba7a88a - Init COMPLETE
"""

# NVIDIA/nccl-tests issue #273: one process, 8 GPUs; rank 2 shows only its "Init timings" line
# in the excerpt, rank 1 nothing.
EIGHT_RANKS_EXCERPT = """\
dc02-p21-t208-n012:7622:7638 [2] NCCL INFO Init timings: rank 2 nranks 8 total 0.66 (kernels 0.42, bootstrap 0.07, allgathers 0.03, topo 0.06, graphs 0.05, connections 0.02, rest 0.00)
dc02-p21-t208-n012:7622:7642 [6] NCCL INFO ncclCommInitRank comm 0x55555b0ba430 rank 6 nranks 8 cudaDev 6 nvmlDev 6 busId bb000 commId 0xb1a317b2c0f1498c - Init COMPLETE
dc02-p21-t208-n012:7622:7640 [4] NCCL INFO ncclCommInitRank comm 0x55555b048e40 rank 4 nranks 8 cudaDev 4 nvmlDev 4 busId 9a000 commId 0xb1a317b2c0f1498c - Init COMPLETE
dc02-p21-t208-n012:7622:7636 [0] NCCL INFO ncclCommInitRank comm 0x55555af62920 rank 0 nranks 8 cudaDev 0 nvmlDev 0 busId 18000 commId 0xb1a317b2c0f1498c - Init COMPLETE
dc02-p21-t208-n012:7622:7641 [5] NCCL INFO ncclCommInitRank comm 0x55555b081960 rank 5 nranks 8 cudaDev 5 nvmlDev 5 busId 9b000 commId 0xb1a317b2c0f1498c - Init COMPLETE
dc02-p21-t208-n012:7622:7639 [3] NCCL INFO ncclCommInitRank comm 0x55555b010370 rank 3 nranks 8 cudaDev 3 nvmlDev 3 busId 3c000 commId 0xb1a317b2c0f1498c - Init COMPLETE
dc02-p21-t208-n012:7622:7643 [7] NCCL INFO ncclCommInitRank comm 0x55555b0f2f50 rank 7 nranks 8 cudaDev 7 nvmlDev 7 busId bc000 commId 0xb1a317b2c0f1498c - Init COMPLETE
"""

# Older NCCL (no nvmlDev/commId, no function name), NVIDIA/nccl issue #629.
OLD_FORMAT = """\
A03-R28-I49-3-9000018:193027:193119 [7] NCCL INFO comm 0x7fdf08000d00 rank 15 nranks 16 cudaDev 7 busId e7000 - Init COMPLETE
A03-R28-I49-2-6000166:58077:58137 [2] NCCL INFO comm 0x7f30b0000d00 rank 2 nranks 16 cudaDev 2 busId 64000 - Init COMPLETE
"""

# Init START lines behind an mpirun host prefix, NVIDIA/nccl issue #1029 (two of 16 ranks).
STARTED_ONLY = """\
rdma-gpu-train-worker-0: rdma-gpu-train-worker-0:19484:21054 [0] NCCL INFO comm 0x557e83314500 rank 0 nranks 16 cudaDev 0 nvmlDev 0 busId 4f000 commId 0x9ad9b5e4ab2566da - Init START
rdma-gpu-train-worker-0: rdma-gpu-train-worker-0:19485:21058 [1] NCCL INFO comm 0x55d8ac4ad300 rank 1 nranks 16 cudaDev 1 nvmlDev 1 busId 52000 commId 0x9ad9b5e4ab2566da - Init START
"""

# A split communicator (NCCL 2.2x "parent ... key %d- Init START" form), code index id 69541820114.
SPLIT_START = ("ubuntu4:251908:251908 [1] NCCL INFO ncclCommShrink comm 0x560a53c8c740 rank 1 "
               "nranks 2 cudaDev 1 nvmlDev 1 busId b1000 parent 0x560a4f522ae0 childCount 0 "
               "color 0 key 3- Init START")


def test_nccl_comm_lines_parse_the_documented_format():
    rows = nccl_comm_lines(TWO_RANKS_COMPLETE)
    assert [(r["host"], r["pid"], r["cuda_dev"], r["rank"], r["nranks"], r["state"])
            for r in rows] == [("node0", 23441, 1, 1, 2, "COMPLETE"),
                               ("node0", 23440, 0, 0, 2, "COMPLETE")]
    old = nccl_comm_lines(OLD_FORMAT)
    assert [(r["rank"], r["nranks"], r["state"]) for r in old] == [(15, 16, "COMPLETE"),
                                                                   (2, 16, "COMPLETE")]
    started = nccl_comm_lines(STARTED_ONLY)
    assert [(r["host"], r["pid"], r["rank"], r["state"]) for r in started] == [
        ("rdma-gpu-train-worker-0", 19484, 0, "START"),
        ("rdma-gpu-train-worker-0", 19485, 1, "START")]
    split = nccl_comm_lines(SPLIT_START)
    assert [(r["rank"], r["nranks"], r["state"]) for r in split] == [(1, 2, "START")]


def test_per_rank_nccl_pass_on_a_complete_world():
    g = per_rank_nccl(TWO_RANKS_COMPLETE, 2)
    assert g["status"] == "PASS"
    assert g["observed"]["ranks_complete"] == [0, 1]
    assert len(g["evidence"]) == 2


def test_per_rank_nccl_names_the_missing_ranks():
    g = per_rank_nccl(EIGHT_RANKS_EXCERPT, 8)
    assert g["status"] == "FAIL"
    assert g["observed"]["missing"] == [1, 2]   # "Init timings" is not a completed init
    assert "rank(s) 1, 2 of 8 never completed NCCL init" in g["reason"]
    # Communicators of another size do not count for this world.
    assert per_rank_nccl(TWO_RANKS_COMPLETE, 8)["observed"]["missing"] == list(range(8))


def test_per_rank_nccl_started_but_not_completed():
    g = per_rank_nccl(STARTED_ONLY, 16)
    assert g["status"] == "FAIL"
    assert "started but not completed: 0, 1" in g["reason"]


# --- aws-ofi-nccl provider lines quoted verbatim ----------------------------------------------------
# aws-ofi-nccl <= 1.13 format ("Selected Provider is %s (found %d nics)"), 2x p5en H200,
# NVIDIA/nccl issue #1597.
EFA_OLD = "8h200-3:6310:6318 [0] NCCL INFO NET/OFI Selected Provider is efa (found 16 nics)"
# aws-ofi-nccl >= 1.14 format ("Selected provider is %s, fabric is %s (found %d nics)"), behind a
# CloudWatch timestamp glued to the host name, aws/aws-ofi-nccl issue #889.
EFA_NEW = ("2025-05-16T16:39:55.210-07:00ip-10-36-29-253:79:2547 [0] NCCL INFO NET/OFI Selected "
           "provider is efa, fabric is efa (found 4 nics)")
# The TCP fallback, logged at WARN (a public troubleshooting page, code index id 54710836900).
TCP = "NCCL WARN NET/OFI Selected provider is tcp, fabric is 10.224.0.0/12 (found 8 nics)"


def test_efa_provider_counts_processes_without_rank_lines():
    g = efa_provider_per_rank(EFA_OLD + "\n" + EFA_NEW, 2)
    assert g["status"] == "PASS"
    assert g["observed"]["efa_processes"] == 2
    assert "counts processes, not named ranks" in g["reason"]
    assert efa_provider_per_rank(EFA_OLD, 2)["status"] == "FAIL"
    assert efa_provider_per_rank(EFA_OLD)["status"] == "PASS"


def test_efa_provider_rejects_tcp():
    g = efa_provider_per_rank(EFA_OLD + "\n" + TCP, 2)
    assert g["status"] == "FAIL"
    assert "selected tcp, not efa" in g["reason"]
    assert g["evidence"][0].endswith(TCP)


def test_efa_provider_missing_entirely():
    g = efa_provider_per_rank(TWO_RANKS_COMPLETE, 2)
    assert g["status"] == "FAIL" and "no 'Selected provider is efa' line" in g["reason"]


def test_efa_provider_ties_lines_to_ranks_through_init_lines():
    # Rank lines for 8 ranks in one process (nccl-tests #273) and an EFA line from another host:
    # every rank that has init lines but no EFA line of its own process is named.
    g = efa_provider_per_rank(EIGHT_RANKS_EXCERPT + EFA_OLD, 8)
    assert g["status"] == "FAIL"
    assert "no EFA provider line from rank(s) 0, 1, 2, 3, 4, 5, 6, 7 of 8" in g["reason"]


# --- eager vs CUDA graphs, EP on vs off ----------------------------------------------------------
def test_compile_mode_gate_on_the_real_eager_log():
    from lib.engines.vllm_logs import compile_mode_gate

    text = (FIXTURES / "vllm-0.24.0-2xh200" / "vllm-allgather_reducescatter.log").read_text()
    assert compile_mode_gate(text, True, log_name="x.log")["status"] == "PASS"
    asked_graphs = compile_mode_gate(text, False, log_name="x.log")
    assert asked_graphs["status"] == "FAIL"
    assert "Enforce eager set" in asked_graphs["reason"]
    assert asked_graphs["evidence"][0].startswith("x.log:16: ")


def test_compile_mode_gate_graphs_line_in_vllms_format():
    from lib.engines.vllm_logs import compile_mode_gate

    # vLLM 0.24.0's format string (gpu_model_runner.py): "Graph capturing finished in %.0f secs,
    # took %.2f GiB"; no recorded log of a graph serve exists yet.
    line = ("(Worker_DP0_EP0 pid=7) INFO 11-30 12:40:01 [gpu_model_runner.py:6657] Graph "
            "capturing finished in 6 secs, took 0.42 GiB")
    assert compile_mode_gate(line, False)["status"] == "PASS"
    assert compile_mode_gate(line, True)["status"] == "FAIL"
    assert compile_mode_gate("", False)["status"] == "FAIL"


def test_expert_parallel_off_gate_on_the_recorded_serve_without_ep():
    """vLLM 0.24.0 at DP=2 without --enable-expert-parallel (recorded on 2x H200): no EP
    split, the DP fallback line, and the AllGather+ReduceScatter manager: PASS."""
    from lib.engines.vllm_logs import expert_parallel_off_gate

    text = NOEP_LOG.read_text()
    got = expert_parallel_off_gate(text, dp_size=2, log_name="06/vllm-eager-noep.log")
    assert got["status"] == "PASS", got
    assert got["observed"] == {"ep_split_lines": 0, "all2all_managers": ["AgRsAll2AllManager"],
                               "dp_fallback_lines": 1}
    assert any("Detected DP deployment with no --enable-expert-parallel" in e
               for e in got["evidence"])


def test_expert_parallel_off_gate_fails_on_what_a_serve_without_ep_never_logs():
    from lib.engines.vllm_logs import expert_parallel_off_gate

    # a serve WITH EP (its recorded log): an EP split
    with_ep = expert_parallel_off_gate((RECORDED_06 / "vllm-eager-ep.log").read_text(),
                                       dp_size=2)
    assert with_ep["status"] == "FAIL" and with_ep["observed"]["ep_split_lines"] >= 1
    assert "EP split" in with_ep["reason"]
    text = NOEP_LOG.read_text()
    # another manager than the DP fallback's (DeepEP's, as the deepep_v2 serve logs it)
    deepep = (FIXTURES / "vllm-0.24.0-2xh200" / "vllm-deepep_v2-run2.log").read_text()
    manager = next(l for l in deepep.splitlines() if "DeepEPV2All2AllManager all2all manager" in l)
    other = expert_parallel_off_gate(text + "\n" + manager, dp_size=2)
    assert other["status"] == "FAIL" and "DeepEPV2All2AllManager" in other["reason"]
    # the fallback line missing at DP=2
    missing = "\n".join(l for l in text.splitlines() if "Detected DP deployment" not in l)
    assert "fallback line" in expert_parallel_off_gate(missing, dp_size=2)["reason"]
    # at DP=1 vLLM builds no manager and logs no fallback: the recorded DP=2 log FAILs there
    assert expert_parallel_off_gate(text, dp_size=1)["status"] == "FAIL"
    bare = "\n".join(l for l in missing.splitlines() if "all2all manager" not in l)
    assert expert_parallel_off_gate(bare, dp_size=1)["status"] == "PASS"


def test_first_fatal_line_of_a_server_that_died_and_none_of_one_that_did_not():
    """Run gpu-2xh200-deepep-vllm-20261130d on 2x H200: graphs+EP on deepep_v2 died under
    traffic (a device-side assert, then AcceleratorError, then the engine's fatal error); the
    eager servers beside it were stopped cleanly and their logs name nothing fatal."""
    from lib.engines.vllm_logs import first_fatal_line

    run = Path(__file__).resolve().parents[1] / "results" / "gpu-2xh200-deepep-vllm-20261130d"
    died = (run / "06_multicomm" / "vllm-graphs-ep-1.log").read_text()
    quote = first_fatal_line(died, log_name="06_multicomm/vllm-graphs-ep-1.log")
    assert quote.startswith("06_multicomm/vllm-graphs-ep-1.log:")
    assert "IndexKernel.cu:111" in quote and "index out of bounds" in quote
    lineno = int(quote.split(":")[1])
    assert "Assertion" in died.splitlines()[lineno - 1]
    last_assert = max(i for i, l in enumerate(died.splitlines(), 1) if "Assertion" in l)
    after = first_fatal_line(died, after_line=last_assert)  # what followed the asserts
    assert after and ("AcceleratorError" in after or "CUDA error: " in after
                      or "fatal error" in after)
    for clean in ("vllm-eager-ep-1.log", "vllm-eager-ep-2.log", "vllm-eager-noep.log"):
        assert first_fatal_line((run / "06_multicomm" / clean).read_text()) is None, clean


def test_quoted_line_numbers_are_the_ones_grep_prints_past_progress_bars():
    """The same log as the door reads it (carriage returns kept): its 140 progress-bar frames no
    longer count as lines, so the number quoted is `grep -n`'s (687, where universal newlines
    made it 712), and a worker's frame keeps its "(Worker_... pid=N)" prefix."""
    import subprocess

    from lib.engines.vllm_logs import _lines, first_fatal_line

    log = (Path(__file__).resolve().parents[1] / "results" / "gpu-2xh200-deepep-vllm-20261130d"
           / "06_multicomm" / "vllm-graphs-ep-1.log")
    with open(log, encoding="utf-8", newline="") as f:
        text = f.read()
    assert "\r" in text
    quote = first_fatal_line(text, log_name="vllm-graphs-ep-1.log")
    grep = subprocess.run(["grep", "-n", "-m1", "IndexKernel.cu:111", str(log)],
                          capture_output=True, text=True, check=True).stdout
    assert quote.split(":")[1] == grep.split(":")[0]
    assert len(_lines(text)) == int(subprocess.run(["wc", "-l", str(log)], capture_output=True,
                                                   text=True, check=True).stdout.split()[0])
    loading = [l for l in _lines(text) if "Loading safetensors checkpoint shards: 100%" in l]
    assert loading and all(l.startswith("(Worker_DP") and "\r" not in l for l in loading)


def test_the_step_a_dying_engine_core_dumped_and_none_where_nothing_died():
    """Both graphs+EP starts of run gpu-2xh200-deepep-vllm-20261130d died on DP rank 1: the
    first in a step of 135 tokens (a new 134-token prompt beside one decode), the second in a
    1-token decode step; the eager servers that were stopped cleanly dumped nothing."""
    from lib.engines.vllm_logs import crashed_step, describe_step

    run = Path(__file__).resolve().parents[1] / "results" / "gpu-2xh200-deepep-vllm-20261130d"
    logs = run / "06_multicomm"
    first = crashed_step((logs / "vllm-graphs-ep-1.log").read_text(), log_name="a.log")
    assert {k: first[k] for k in ("engine_core", "scheduled_tokens", "new_prompt_tokens",
                                  "running", "waiting")} == {
        "engine_core": "EngineCore_DP1", "scheduled_tokens": 135, "new_prompt_tokens": [134],
        "running": 2, "waiting": 0}
    assert first["quote"].startswith("a.log:") and "[dump_input.py:79]" in first["quote"]
    assert describe_step(first) == ("EngineCore_DP1 was running a step of 135 scheduled tokens "
                                    "(new prompts of 134 tokens; 2 running, 0 waiting)")
    second = crashed_step((logs / "vllm-graphs-ep-2.log").read_text())
    assert describe_step(second) == ("EngineCore_DP1 was running a step of 1 scheduled token "
                                     "(no new prompt; 3 running, 0 waiting)")
    for clean in ("vllm-eager-ep-1.log", "vllm-eager-ep-2.log", "vllm-eager-noep.log"):
        assert crashed_step((logs / clean).read_text()) is None, clean
    # a dump without its stats line (a log cut short) still names the step, with no counts
    cut = [l for l in (logs / "vllm-graphs-ep-1.log").read_text().splitlines()
           if "dump_input.py:81" not in l]
    assert describe_step(crashed_step("\n".join(cut))) == (
        "EngineCore_DP1 was running a step of 135 scheduled tokens (new prompts of 134 tokens)")
