"""The committed reference runs: sealed, complete, and their gates hold."""
import json
import subprocess

import pytest

from lib.core import evidence
from lib.publish import appendix, catalog, pages, report
from lib.core.door import REPO_ROOT
from lib.stages.registry import STAGES

RESULTS = REPO_ROOT / "results"
REFERENCE = (RESULTS / "REFERENCE").read_text().strip()
FURTHER = sorted(catalog.replayed_notebooks(RESULTS))
RUNS = {r.run_id: r for r in catalog.catalog(RESULTS)}


@pytest.mark.parametrize("run_id", [REFERENCE, *FURTHER])
def test_a_reference_run_is_sealed(run_id):
    run = RESULTS / run_id
    assert evidence.verify(run) == []
    assert subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=run).returncode == 0


def test_the_cpu_reference_run_has_every_stage_and_no_fail():
    run = RESULTS / REFERENCE
    for stage in STAGES:
        gates = evidence.read_gates(run / stage)
        assert gates, f"{stage} missing from the reference run"
        assert not [g for g in gates if g["status"] == "FAIL"], stage
        assert all(g["reason"] for g in gates if g["status"] == "SKIP")
    notebooks = sorted(p.stem for p in (REPO_ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks == list(STAGES)
    for stage in STAGES:  # the committed notebooks are that run's executed notebooks, without
        # papermill's injected-parameters cell (naming the run: lib.runner.store_reference)
        stored = json.loads((REPO_ROOT / "notebooks" / f"{stage}.ipynb").read_text())
        recorded = json.loads((run / "notebooks" / f"{stage}.ipynb").read_text())
        recorded["cells"] = [c for c in recorded["cells"] if "injected-parameters"
                             not in c.get("metadata", {}).get("tags", [])]
        assert [c.get("outputs") for c in stored["cells"]] == \
               [c.get("outputs") for c in recorded["cells"]]


def context_of(run_id: str) -> str:
    return evidence.read_json(RESULTS / run_id / "run.json")["context"]


# the runs on real GPUs (local context): none replays (each was recorded by an older guide), each
# is shown and checked through its evidence (DESIGN.md, Reference runs age)
GPU_RUNS = [r for r, run in RUNS.items() if run.context == "local" and r != REFERENCE
            and catalog.host_facts(run.path).get("gpus")]
CLUSTER_RUNS = [r for r in FURTHER if context_of(r) != "local"]
# those whose stage passed (a FAILed one is kept as recorded: its page lists the gates)
KERNEL_RUNS = [r for r in GPU_RUNS if (RESULTS / r / "03_kernel_test" / "result.json").exists()
               and RUNS[r].stages.get("03_kernel_test") == "PASS"]
VLLM_RUNS = [r for r in GPU_RUNS if (RESULTS / r / "04_serve" / "vllm_serve.json").exists()
             and RUNS[r].stages.get("04_serve") == "PASS"]


def test_the_gpu_reference_runs_cover_the_kernel_and_vllm():
    assert KERNEL_RUNS and VLLM_RUNS


@pytest.mark.parametrize("run_id", GPU_RUNS)
def test_a_gpu_run_not_replayed_is_shown_through_its_evidence(run_id):
    """Its page: its level, the guide commit that recorded it, its files checked against
    SHA256SUMS, and why make test does not replay it."""
    run = RUNS[run_id]
    assert not run.replayed
    facts = dict(appendix.run_facts(run))
    sha = (run.record.get("guide") or {}).get("git_sha")
    said = f"`{sha[:12]}`" if sha else "an unrecorded commit"
    assert facts["level"] == run.level and (sha or "not recorded") in facts["guide"]
    assert facts["evidence"].endswith(
        "every file matches SHA256SUMS (written when the run ended; a run whose files changed "
        "since is never published)") == (evidence.verify(run.path) == [])
    assert facts["replayed by make test"].startswith(f"no: recorded by the guide at {said}")
    assert "shown through its evidence" in facts["replayed by make test"]


KUBE_RUNS = [r for r in CLUSTER_RUNS if context_of(r) == "kube"]
SLURM_RUNS = [r for r in CLUSTER_RUNS if context_of(r) == "slurm"]


def test_the_cluster_paths_have_a_committed_run_each():
    assert KUBE_RUNS and SLURM_RUNS


@pytest.mark.parametrize("run_id", KUBE_RUNS)
def test_a_kube_run_says_what_was_real_and_serves_sixteen_ranks(run_id):
    """A run on the test control plane: its level names the simulated nodes (the book shows
    it), its serve proves the backend and NCCL's EFA provider on all 16 ranks of two nodes."""
    run = RESULTS / run_id
    assert "nodes simulated" in evidence.read_json(run / "run.json")["level"]
    assert "nodes simulated" in RUNS[run_id].level and not RUNS[run_id].feeds_results
    served = {g["gate"]: g for g in evidence.read_gates(run / "04_serve")}
    assert {g["status"] for g in served.values()} == {"PASS"}
    engine = evidence.read_json(run / "04_serve" / "params.json").get("engine") or "vllm"
    if engine == "trtllm":  # R's logs hold no NCCL Init COMPLETE: its lanes' rank lines
        ranks = served["trtllm_deepep_rank_per_rank"]["observed"]["ranks"]
    else:
        ranks = served["nccl_init_per_rank"]["observed"]["ranks_complete"]
    assert ranks == list(range(16))
    assert served["efa_provider_per_rank"]["status"] == "PASS"
    title = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}[engine]
    assert RUNS[run_id].serving == f"{title}, deepep_v2"
    assert "nodes simulated" in appendix.run_page(RUNS[run_id], REFERENCE)


@pytest.mark.parametrize("run_id", SLURM_RUNS)
def test_a_slurm_run_measured_across_both_nodes_with_a_real_scheduler(run_id):
    run = RESULTS / run_id
    assert "scheduler real" in evidence.read_json(run / "run.json")["level"]
    for stage in ("00_cluster", "03_kernel_test", "04_serve", "05_sweep"):
        assert not [g for g in evidence.read_gates(run / stage) if g["status"] == "FAIL"], stage
    nodes = evidence.read_json(run / "00_cluster" / "nodes.json")
    assert [n["node"] for n in nodes] == ["n1", "n2"]
    result = evidence.read_json(run / "03_kernel_test" / "result.json")
    assert result["correct"] and result["config"]["world_size"] == 2
    assert [r["correct"] for r in result["ranks"]] == [True, True]  # a rank on each node


@pytest.mark.parametrize("run_id", VLLM_RUNS)
def test_a_vllm_reference_run_proves_its_backend_per_rank(run_id):
    run = RESULTS / run_id
    served = {g["gate"]: g for g in evidence.read_gates(run / "04_serve")}
    assert {g["status"] for g in served.values()} == {"PASS"}
    for name in ("vllm_all2all_manager", "vllm_ep_split", "vllm_prepare_finalize",
                 "vllm_api_servers_ready", "vllm_no_fallback_no_legacy_buffer",
                 "vllm_compile_mode", "nccl_init_per_rank"):
        assert served[name]["status"] == "PASS"
    assert served["nccl_init_per_rank"]["observed"]["ranks_complete"] == [0, 1]
    if not (run / "05_sweep").is_dir():  # a run of 04 and 06 only
        return
    swept = evidence.read_gates(run / "05_sweep")
    assert not [g for g in swept if g["status"] == "FAIL"]
    counted = [g for g in swept if g["gate"].endswith("vLLM counted the generated tokens")]
    assert counted and all(g["status"] == "PASS" for g in counted)


@pytest.mark.parametrize("run_id", KERNEL_RUNS)
def test_a_gpu_reference_run_measured_nccl_with_correctness(run_id):
    run = RESULTS / run_id
    result = evidence.read_json(run / "03_kernel_test" / "result.json")
    assert result["config"]["backend"] == "nccl" and result["correct"] is True
    gates = {g["gate"]: g["status"] for g in evidence.read_gates(run / "03_kernel_test")}
    # every gate PASS, but the EFA-provider gates of DeepEP's test_ep: SKIP over NVLink
    assert {s for n, s in gates.items() if not n.endswith("EFA provider selected on every rank")} \
        == {"PASS"}
    assert {s for n, s in gates.items() if n.endswith("EFA provider selected on every rank")} \
        <= {"SKIP"}


def test_committed_notebooks_declare_every_parameter_of_their_stage():
    """The parameters cell is what papermill (and a reader) sees: it must be lib.publish.notebooks'
    current one, naming every parameter lib.params declares for the stage."""
    from lib.publish.notebooks import parameters_source

    for stage in STAGES:
        stored = json.loads((REPO_ROOT / "notebooks" / f"{stage}.ipynb").read_text())
        cell = next(c for c in stored["cells"] if "parameters" in c["metadata"].get("tags", []))
        assert "".join(cell["source"]) == parameters_source(stage), stage


@pytest.mark.parametrize("run_id", VLLM_RUNS)
def test_the_book_shows_a_vllm_run_from_its_evidence(run_id):
    import pandas as pd

    section = appendix.run_page(RUNS[run_id], REFERENCE)
    assert "## vLLM serve (04)" in section
    served = evidence.read_json(RESULTS / run_id / "04_serve" / "vllm_serve.json")
    assert f"ready after {served['ready_s']} s" in section
    if not (RESULTS / run_id / "05_sweep").is_dir():
        assert "## vLLM sweep (05)" not in section
        return
    assert "## vLLM sweep (05)" in section
    summary = pd.read_csv(RESULTS / run_id / "05_sweep" / "summary.csv")
    for (arm, c), values in summary.groupby(["arm", "concurrency"])["output_tps"]:
        assert f"| {arm} | {c} | {round(values.median(), 1)} |" in section
    ratios_path = RESULTS / run_id / "05_sweep" / "ratios.json"
    for r in evidence.read_json(ratios_path) if ratios_path.exists() else []:
        each = ", ".join(f"{v:.0f}" for v in r["b_tps"])  # the repeats, not only the interval
        assert f"| {r['shape']} | {r['concurrency']} | {r['n']} | " in section and each in section


def test_the_comparison_page_compares_only_the_same_work():
    """DeepEP's test_ep at the published shape beside the published figure; everything else
    (the torch benchmark, serving, the CPU and cluster-test runs) one line saying why not."""
    ev = pages.Evidence(list(RUNS.values()))
    page = pages.comparison_page(ev, None)
    assert ev.kernel_run is not None and f"`{ev.kernel_run.run_id}`" in page
    assert "outside" not in page and "±10%" not in page  # no tolerance band across hardware
    not_compared = page.split("## Not compared", 1)[1]
    for what in ("The torch benchmark", "Serving", "CPU, Kubernetes and Slurm runs"):
        assert what in not_compared
    assert "not available at build time" in page  # no public tree given here


DEEPEP_RUNS = [r for r in FURTHER if (RESULTS / r / "03_kernel_test" / "test_ep.json").exists()]


def test_a_deepep_run_is_compared_with_deepeps_own_figures_not_the_torch_benchmark():
    from lib.measure import published

    assert DEEPEP_RUNS
    ev = pages.Evidence(list(RUNS.values()))
    row = next(r for r in evidence.read_json(RESULTS / ev.kernel_run.run_id / "03_kernel_test"
                                              / "test_ep.json")
               if r["tokens"] == published.MICROBENCH_TOKENS)
    table = pages.comparison_page(ev, None).split("## Not compared", 1)[0]
    line = next(x for x in table.splitlines() if x.startswith("| test_ep D+C p50 |"))
    assert f"| {row['test_ep D+C p50 (us)']:.1f} |" in line
    assert f"{row['torch D+C p50 (us)']:.1f}" not in line


def test_deepep_figures_come_only_from_a_passing_gate_at_the_published_token_count():
    from lib.measure import published

    observed = {"num_tokens": 128, "dispatch_p50_us": 15.0, "combine_p50_us": 14.0,
                "dc_p50_us": 29.0}
    name = "test_ep 128 tokens: dispatch+combine p50 recorded"
    assert published.figures_from_test_ep_gates(
        [{"gate": name, "status": "PASS", "observed": observed}]) == {
        "test_ep dispatch p50": 15.0, "test_ep combine p50": 14.0, "test_ep D+C p50": 29.0}
    assert published.figures_from_test_ep_gates(
        [{"gate": name, "status": "FAIL", "observed": observed}]) == {}
    assert published.figures_from_test_ep_gates(
        [{"gate": name.replace("128", "512"), "status": "PASS",
          "observed": {**observed, "num_tokens": 512}}]) == {}


@pytest.mark.parametrize("run_id", KERNEL_RUNS)
def test_the_book_says_which_combine_made_a_kernel_figure(run_id):
    result = evidence.read_json(RESULTS / run_id / "03_kernel_test" / "result.json")
    figures = report.kernel_figures(RESULTS / run_id)
    assert figures["combine"] == result.get("combine_impl",
                                            "index_select_sum (recorded before the field)")
    assert figures["combine"].startswith(("gather_sum", "index_select_sum"))


def test_the_book_says_a_failed_arm_plainly():
    """Run gpu-2xh200-deepep-vllm-20261130d, whose graphs+EP arm died under traffic (45 AIPerf
    cell gates and 3 ratio gates FAILed): the book shows one row per failed check naming the
    cells, no terminal codes (AIPerf colours its error box), and its ratios as not measured."""
    run_id = "gpu-2xh200-deepep-vllm-20261130d"
    recorded = [g for g in evidence.read_gates(RESULTS / run_id / "06_multicomm")
                if g["status"] == "FAIL"]
    assert len(recorded) == 48 and any("\x1b[" in g["reason"] for g in recorded)
    section = appendix.run_page(RUNS[run_id], REFERENCE)
    failed = section.split("## Gates that did not pass", 1)[1].split("SKIP:", 1)[0]
    rows = [line for line in failed.splitlines() if line.startswith("| 06_multicomm")]
    assert len(rows) == 8  # 5 checks x 9 cells, grouped, and the 3 ratios
    assert "| aiperf vllm-graphs-ep c{C} repeat {R}: AIPerf exit 0 (9: c4 r1, c8 r1, c32 r1, " \
           "c4 r2" in failed
    assert "\x1b" not in section and "[1;31m" not in section
    assert "Reason: All 48 inference request(s) failed." in failed
    assert "| graphs+EP / eager+EP | 32 | 0 | not measured | not measured |" in section
    assert "| eager, no EP / eager+EP | 32 | 3 | 0.838 | 0.662 to 1.246 |" in section


def test_a_ratio_table_shows_each_rounds_own_ratio_beside_the_interval():
    """Run gpu-2xh200-deepep-vllm-20261130d's 06: each paired round's b / a, computed from the
    recorded throughputs of the same round (c4: 466/465, 601/530, 626/605), and the note saying
    why a 3-repeat bootstrap interval can end at the ratio (c4's 1.035 to 1.134 does); an
    unmeasured ratio has no rounds."""
    run_id = "gpu-2xh200-deepep-vllm-20261130d"
    section = "\n".join(report.vllm_sections(RESULTS / run_id))
    serving = section.split("### vLLM serving A/B (06)", 1)[1]
    assert ("| eager, no EP / eager+EP | 4 | 3 | 1.134 | 1.035 to 1.134 | 465, 530, 605 | "
            "466, 601, 626 | 1.002, 1.134, 1.035 |") in serving
    assert "| graphs+EP / eager+EP | 4 | 0 | not measured | not measured |  |  |  |" in serving
    assert report.FEW_REPEATS_NOTE in serving
    ratios = evidence.read_json(RESULTS / run_id / "06_multicomm" / "ratios.json")
    c32 = next(r for r in ratios if r["concurrency"] == 32 and r["n"] == 3)
    rounds = [float(x) for x in report._each_ratio(c32["a_tps"], c32["b_tps"]).split(", ")]
    assert rounds == [round(b / a, 3) for a, b in zip(c32["a_tps"], c32["b_tps"])]
    assert min(rounds) <= c32["low"] + 1e-3 and max(rounds) >= c32["high"] - 1e-3
