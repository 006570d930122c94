"""lib.measure.triage: the first rank to fail, across a multi-node job's logs.

On the composed 16-rank test_ep failure (tests/compose.py: rank 11 dies, the others time out),
on vLLM 0.24.0's recorded crashes on 2x H200 (results/: the engine cores' own lines say which DP
rank died), on the recorded clean serves (../shared/fixtures/vllm-0.24.0-2xh200) and on logs
holding nothing but timeouts.
"""
import re

import pytest

from lib.core.door import REPO_ROOT
from lib.measure.triage import GATE_FIRST_RANK, log_lines, read_log, triage, triage_gate
from tests import compose
from tests.compose import FIXTURES

VLLM_FIXTURES = FIXTURES / "vllm-0.24.0-2xh200"
# vLLM 0.24.0 serves on 2x H200 that crashed (recorded by this guide's runs)
CRASHES = (
    "results/gpu-2xh200-deepep-vllm-20261130d/06_multicomm/vllm-graphs-ep-1.log",
    "results/gpu-2xh200-deepep-vllm-20261130d/06_multicomm/vllm-graphs-ep-2.log",
    "results/gpu-2xh200-deepep-vllm-20261130c/06_multicomm/vllm-graphs-ep.log",
    "results/diagnostics/deepep_v2-nographs-20261201/vllm-nographs.log",
)
# What vLLM's engine core says when its rank died: "(EngineCore_DP1 pid=N) ERROR ... Worker proc
# VllmWorker-0 died unexpectedly" / "EngineCore encountered a fatal error." / "failed to start."
VLLM_SAYS_DIED = re.compile(r"\(EngineCore_DP(\d+) pid=\d+\) ERROR .*(?:died unexpectedly|"
                            r"encountered a fatal error|failed to start)")


def recorded(path):
    assert path.is_file(), f"recorded log missing: {path}"
    return read_log(path)


def as_logs(paths):
    return {p.name: read_log(p) for p in paths}


def check_line_numbers(logs, first):
    """The line number is grep -n's: the source's line at that number is the line quoted."""
    lines = log_lines(logs[first["source"]])
    assert lines[first["line_number"] - 1].replace("\r", "").rstrip() == first["line"]


def gate_shape(g):
    assert set(g) == {"gate", "status", "observed", "expected", "reason", "evidence"}
    assert g["gate"] == GATE_FIRST_RANK and g["status"] in ("PASS", "FAIL") and g["reason"]


# --- the composed test_ep failure ---------------------------------------------------------------
def test_rank_11_died_first_and_fifteen_timeouts_are_its_symptoms(tmp_path):
    logs = as_logs(compose.compose_test_ep_failure(tmp_path, dead_rank=11))
    t = triage(logs)
    first = t["first"]
    assert first["rank"] == 11 and first["kind"] == "error"
    assert first["source"].endswith("-node1.log")
    assert first["line"] == ("[rank11]: torch.AcceleratorError: CUDA error: an illegal memory "
                             "access was encountered")
    check_line_numbers(logs, first)
    assert first["block_start"] < first["line_number"]  # its traceback starts above
    assert t["failed_ranks"] == [11]
    assert t["symptom_lines"] == 15
    assert t["symptom_ranks"] == [r for r in range(16) if r != 11]
    assert not t["symptoms_only"]

    g = triage_gate(logs, evidence=["composed test_ep logs"])
    gate_shape(g)
    assert g["status"] == "FAIL"
    assert g["observed"]["rank"] == 11 and g["observed"]["symptom_lines"] == 15
    assert g["reason"].startswith("rank 11 failed first: ")
    assert "the 15 timeout line(s) on 15 other rank(s)" in g["reason"]
    assert "are symptoms of it, not causes" in g["reason"]
    assert g["evidence"][0] == "composed test_ep logs"
    assert any(e.endswith(first["line"]) for e in g["evidence"])
    assert any("Gin barrier timeout" in e for e in g["evidence"])


def test_node_mates_its_launcher_stopped_are_not_failures(tmp_path):
    """torchrun stops the dead rank's node-mates (SIGTERM, exitcode -15): only the other node
    times out, and a stopped rank is no failure of its own."""
    logs = as_logs(compose.compose_test_ep_failure(tmp_path, dead_rank=11,
                                                   siblings="terminated"))
    t = triage(logs)
    assert t["first"]["rank"] == 11 and t["failed_ranks"] == [11]
    assert t["symptom_lines"] == 8 and t["symptom_ranks"] == list(range(8))
    assert t["downstream_lines"] >= 7


def test_another_dead_rank_is_named_too(tmp_path):
    logs = as_logs(compose.compose_test_ep_failure(tmp_path, dead_rank=2))
    t = triage(logs)
    assert t["first"]["rank"] == 2 and t["first"]["source"].endswith("-node0.log")
    assert t["symptom_lines"] == 15


# --- vLLM's recorded crashes and clean serves ---------------------------------------------------
@pytest.mark.parametrize("rel", CRASHES)
def test_names_the_rank_vllm_says_died(rel):
    text = recorded(REPO_ROOT / rel)
    said = next(int(m.group(1)) for m in map(VLLM_SAYS_DIED.search, log_lines(text)) if m)
    logs = {rel.rsplit("/", 1)[1]: text}
    t = triage(logs)
    assert t["first"]["rank"] == said, (t["first"], said)
    assert said in t["failed_ranks"]
    check_line_numbers(logs, t["first"])
    g = triage_gate(logs)
    assert g["status"] == "FAIL" and g["reason"].startswith(f"rank {said} ")


def test_a_device_assert_takes_the_rank_of_the_worker_that_raised_it():
    """The assert lines name no rank; the worker's AcceleratorError below them does."""
    rel = CRASHES[0]
    text = recorded(REPO_ROOT / rel)
    first = triage({"graphs-ep-1.log": text})["first"]
    assert first["line_number"] == 687  # grep -n's number for the first assert line
    assert "Assertion `-sizes[i] <= index && index < sizes[i]" in first["line"]
    assert first["rank"] == 1 and first["rank_from"].startswith("inferred")
    assert "(Worker_DP1_EP1" in log_lines(text)[int(re.search(
        r"graphs-ep-1\.log:(\d+)", first["rank_from"]).group(1)) - 1]


@pytest.mark.parametrize("name", ["vllm-deepep_v2-run2.log", "vllm-naive.log",
                                  "vllm-allgather_reducescatter-run2.log"])
def test_a_clean_recorded_serve_passes(name):
    g = triage_gate({name: recorded(VLLM_FIXTURES / name)})
    gate_shape(g)
    assert g["status"] == "PASS", g["reason"]
    assert g["reason"] == f"no error line in 1 log(s) ({name})"


def test_errors_after_the_serves_own_shutdown_are_not_counted():
    """vllm-allgather_reducescatter.log: the API server's EngineDeadError comes after vLLM's own
    "[shutdown]" began, with nothing failed before it."""
    name = "vllm-allgather_reducescatter.log"
    t = triage({name: recorded(VLLM_FIXTURES / name)})
    assert t["first"] is None and t["after_shutdown_lines"] >= 1
    assert any("EngineDeadError" in q for q in t["after_shutdown"])
    g = triage_gate({name: recorded(VLLM_FIXTURES / name)})
    assert g["status"] == "PASS" and "after the job's own shutdown began" in g["reason"]
    assert triage({name: recorded(VLLM_FIXTURES / name)},
                  ignore_after_shutdown=False)["first"] is not None


def test_composed_dp16_pods(tmp_path):
    clean = as_logs(compose.compose_vllm_pods(tmp_path))
    assert triage_gate(clean)["status"] == "PASS"
    trapped = as_logs(compose.compose_vllm_pods(tmp_path, sitecustomize_legacy_rank=13,
                                                tag="-sitecustomize"))
    t = triage(trapped)
    assert t["first"]["rank"] == 13 and t["first"]["source"].endswith("-worker1.log")
    assert compose.SITECUSTOMIZE_LEGACY_LINE in t["first"]["line"]


# --- logs holding nothing but timeouts ----------------------------------------------------------
# ProcessGroupNCCL's watchdog, as public logs print it ("[rank0]:[E1218 20:27:21.426415540
# ProcessGroupNCCL.cpp:629] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(...)
# ran for 600081 milliseconds before timing out.", code index id 16716516742); ranks and times
# changed.
WATCHDOG = ("[rank{r}]:[E1218 20:27:21.{us} ProcessGroupNCCL.cpp:629] [Rank {r}] Watchdog caught "
            "collective operation timeout: WorkNCCL(SeqNum=1, OpType=BROADCAST, NumelIn=131072000,"
            " NumelOut=131072000, Timeout(ms)=600000) ran for 600081 milliseconds before timing "
            "out.")


def test_only_timeouts_name_the_earliest_and_say_nothing_else_failed():
    logs = {"node0.log": "starting\n" + WATCHDOG.format(r=3, us="433063423") + "\n",
            "node1.log": WATCHDOG.format(r=12, us="426415540") + "\n"}
    t = triage(logs)
    assert t["symptoms_only"] and t["failed_ranks"] == []
    assert t["first"]["rank"] == 12 and t["first"]["kind"] == "symptom"  # earlier by 7 ms
    assert t["ordered_by"] == "the logs' timestamps"
    assert t["symptom_lines"] == 1 and t["symptom_ranks"] == [3]
    g = triage_gate(logs)
    assert g["status"] == "FAIL"
    assert g["reason"].startswith("only timeouts: no rank logged an error of its own; the "
                                  "earliest is rank 12 at node1.log:1: ")
    assert "Nothing else failed" in g["reason"]


def test_the_failure_without_its_dead_rank_is_only_timeouts(tmp_path):
    """The composed failure with rank 11's own lines gone (a log not collected): 15 timeouts,
    the earliest named, nothing else failed."""
    logs = {p.name: "\n".join(line for line in log_lines(read_log(p))
                              if not line.startswith("[rank11]:")) + "\n"
            for p in compose.compose_test_ep_failure(tmp_path)}
    t = triage(logs)
    assert t["symptoms_only"] and t["failed_ranks"] == []
    # the printf lines carry no time: each log's first timeout (rank 0's, rank 8's) is a
    # candidate, the two cannot be ordered, and the result says so
    assert "Gin barrier timeout" in t["first"]["line"] and t["first"]["rank"] in (0, 8)
    assert t["ordered_by"] == "position only (no timestamps to order the logs)"
    assert len(t["ambiguous"]) == 1 and "Gin barrier timeout" in t["ambiguous"][0]
    g = triage_gate(logs)
    assert g["status"] == "FAIL" and "Nothing else failed" in g["reason"]


# --- formats ------------------------------------------------------------------------------------
def test_a_spawned_process_error_and_nccl_warn_lines():
    """torch.multiprocessing.spawn's re-raise (torch/multiprocessing/spawn.py: "\\n\\n-- Process
    %d terminated with the following error:\\n" + the child's traceback) names a local rank;
    `first_rank` makes it global. An NCCL WARN is an error of the process NCCL ties to a rank."""
    spawned = "\n".join([
        "Traceback (most recent call last):",
        '  File "/opt/DeepEP/tests/elastic/test_ep.py", line 600, in <module>',
        "    torch.multiprocessing.spawn(test_loop, args=(num_processes, args), nprocs=8)",
        "torch.multiprocessing.spawn.ProcessRaisedException: ",
        "",
        "-- Process 3 terminated with the following error:",
        "Traceback (most recent call last):",
        '  File "/opt/DeepEP/tests/elastic/test_ep.py", line 219, in test_dispatch_combine',
        "    assert torch.equal(ref_recv_src_token_idx, sorted_src_token_global_idx)",
        "AssertionError: ref_recv_src_token_idx=tensor([0, 1]), sorted_src_token_global_idx=...",
    ]) + "\n"
    t = triage({"node1.log": spawned}, first_rank={"node1.log": 8})
    assert t["first"]["rank"] == 11 and t["first"]["line"].startswith("AssertionError: ")
    assert t["first"]["line_number"] == 10
    assert triage({"node1.log": spawned})["first"]["local_rank"] == 3

    # NCCL's WARN format (host:pid:tid [dev] file:line NCCL WARN ..., aws/aws-ofi-nccl #1020)
    init = compose.nccl_block("composed-node-1", 5105, 5, 13, 16)
    warn = ("composed-node-1:5105:5116 [5] nccl_net_ofi_rdma_init:7978 NCCL WARN NET/OFI OFI "
            "fi_getinfo() call failed: No data available")
    t = triage({"node1.log": "\n".join(init + [warn]) + "\n"})
    assert t["first"]["rank"] == 13 and t["first"]["rank_from"].startswith("NCCL's init line")
    assert t["first"]["line_number"] == len(init) + 1
