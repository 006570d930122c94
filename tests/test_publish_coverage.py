"""lib.publish.coverage: which run covered which engine on which place, at which level, computed
from run directories (small ones written here, then the committed ones), and the cross-engine
figures of the public reproduction checked against their sources."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lib.engines import catalog as engines
from lib.measure import published
from lib.publish import cited, coverage
from lib.publish.catalog import catalog
from lib.core.door import REPO_ROOT

PUBLIC = REPO_ROOT.parent / "shared" / "fixtures" / "public-repro" / "results"
VLLM_SUMMARIES = {  # the public reproduction's own summaries of its two vLLM arms
    "vLLM 0.24.0, EP_NUM_COMMS 1": "vllm-deepep-dropin-20260706/vllm/t3_aiperf_epnc1_summary.json",
    "vLLM 0.24.0, EP_NUM_COMMS 8 (the multicomm overlay)":
        "vllm-deepep-dropin-20260706/vllm/aiperf-epnc8/t8_aiperf_epnc8_summary.json",
}


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")


def gates(*statuses: str) -> list[dict]:
    return [{"gate": f"gate {i}", "status": s, "observed": None, "expected": None,
             "reason": "", "evidence": []} for i, s in enumerate(statuses)]


def make_run(results: Path, run_id: str, context: str, created: str, *, level: str = "",
             gpus: int = 0, serve: str | None = None, engine: str = "", served_file: bool = False,
             kernel: str | None = None, kernel_files: tuple[str, ...] = (), **params) -> Path:
    """A run directory as the guide writes one: run.json, 00's host facts, and 03 / 04 with
    the given state ('PASS', 'FAIL', 'SKIP'; None: the stage did not run)."""
    run = results / run_id
    record = {"run_id": run_id, "context": context, "created_utc": created,
              "parameters": {"context": context, **params}}
    if level:
        record["level"] = level
    write_json(run / "run.json", record)
    write_json(run / "00_cluster" / "host.json",
               {"cpu_cores": 2, "gpus": [{"name": "NVIDIA H200"}] * gpus})
    write_json(run / "00_cluster" / "gates.json", gates("PASS"))
    if serve:
        write_json(run / "04_serve" / "gates.json", gates(serve))
        write_json(run / "04_serve" / "params.json", {"engine": engine})
        if served_file:
            write_json(run / "04_serve" / f"{engine}_serve.json", {"backend": "deepep_v2"})
    if kernel:
        write_json(run / "03_kernel_test" / "gates.json", gates(kernel))
        for name in kernel_files:  # the shapes lib.stages.kernel writes
            write_json(run / "03_kernel_test" / name,
                       {"config": {"backend": "gloo"}} if name == "result.json" else [])
    return run


KUBE_LEVEL = "control plane real, nodes simulated (a kubelet double)"
SLURM_LEVEL = "scheduler real, nodes are this CPU host"


@pytest.fixture
def results(tmp_path):
    results = tmp_path / "results"
    make_run(results, "gpu-a", "local", "2026-01-01", gpus=2, serve="PASS", engine="vllm",
             served_file=True, kernel="PASS", kernel_files=("test_ep.json", "result.json"))
    make_run(results, "gpu-b", "local", "2026-01-02", gpus=2, serve="FAIL", engine="vllm",
             served_file=True)
    # recorded before `engine` was a parameter: '' in its params, transformers serve it was
    make_run(results, "cpu-a", "local", "2026-01-03", serve="PASS", engine="",
             kernel="PASS", kernel_files=("result.json",))
    make_run(results, "kube-a", "kube", "2026-01-04", level=KUBE_LEVEL, serve="PASS",
             engine="sglang", served_file=True, kernel="FAIL", kernel_files=("test_ep.json",))
    # the place could not run the engine: 04 SKIPs, so the run covers nothing
    make_run(results, "kube-skip", "kube", "2026-01-05", level=KUBE_LEVEL, serve="SKIP",
             engine="trtllm")
    make_run(results, "slurm-cpu", "slurm", "2026-01-06", level=SLURM_LEVEL, serve="PASS",
             engine="transformers", gpus_per_node=0)
    make_run(results, "slurm-gpu", "slurm", "2026-01-07", level=SLURM_LEVEL, serve="PASS",
             engine="trtllm", gpus_per_node=8)
    # a plan's serve SKIPs every gate (rendered, not started): it counts as rendered only
    make_run(results, "plan-a", "plan", "2026-01-08", serve="SKIP", engine="sglang",
             plan_for="slurm")
    return results


def link(run_id: str) -> str:
    return f"[`{run_id}`](runs/{run_id}.md)"


def test_each_cell_is_computed_from_the_runs_that_covered_it(results):
    table = coverage.coverage_table(catalog(results)).set_index("engine / lane")
    assert list(table.columns) == list(coverage.PLACES)
    assert list(table.index) == [e.title for e in engines.ENGINES.values()] + [
        "DeepEP test_ep", "torch benchmark", coverage.TRAINING_LANE, coverage.NEMO_RL_LANE]
    vllm, sglang, trtllm = (table.loc[engines.ENGINES[n].title] for n in ("vllm", "sglang",
                                                                           "trtllm"))
    assert vllm["one GPU host"] == f"**measured**: 2 runs, 1 passing; latest {link('gpu-b')}"
    assert (vllm["one CPU host"], vllm["Kubernetes"], vllm["Slurm"]) == ("not run",) * 3
    assert sglang["Kubernetes"] == (f"**{coverage.SIMULATED_NODES}**: 1 run, 1 passing; "
                                    f"latest {link('kube-a')}")
    assert sglang["Slurm"] == f"**{coverage.RENDERED}**: 1 run, 0 passing; latest {link('plan-a')}"
    # kube-skip covered nothing; the Slurm run that declared GPUs simulated them
    assert trtllm["Kubernetes"] == "not run"
    assert trtllm["Slurm"] == (f"**{coverage.SLURM_SIMULATED_GPUS}**: 1 run, 1 passing; "
                               f"latest {link('slurm-gpu')}")
    serve = table.loc[engines.ENGINES["transformers"].title]
    assert serve["one CPU host"] == f"**measured**: 1 run, 1 passing; latest {link('cpu-a')}"
    assert serve["Slurm"] == (f"**{coverage.SLURM_CPU_NODES}**: 1 run, 1 passing; "
                              f"latest {link('slurm-cpu')}")
    test_ep, torch = table.loc["DeepEP test_ep"], table.loc["torch benchmark"]
    assert test_ep["one GPU host"] == f"**measured**: 1 run, 1 passing; latest {link('gpu-a')}"
    assert test_ep["Kubernetes"] == (f"**{coverage.SIMULATED_NODES}**: 1 run, 0 passing; "
                                     f"latest {link('kube-a')}")
    assert torch["one CPU host"] == f"**measured**: 1 run, 1 passing; latest {link('cpu-a')}"
    assert torch["Kubernetes"] == "not run"  # kube-a wrote test_ep.json only


def test_a_cell_reached_at_two_levels_names_both_best_first(results):
    make_run(results, "plan-b", "plan", "2026-01-09", serve="SKIP", engine="sglang",
             plan_for="kube")
    make_run(results, "kube-b", "kube", "2026-01-10", level=KUBE_LEVEL, serve="FAIL",
             engine="sglang", served_file=True)
    table = coverage.coverage_table(catalog(results)).set_index("engine / lane")
    assert table.loc["SGLang", "Kubernetes"] == (
        f"**{coverage.SIMULATED_NODES}**: 2 runs, 1 passing; latest {link('kube-b')}; "
        f"**{coverage.RENDERED}**: 1 run, 0 passing; latest {link('plan-b')}")
    assert coverage.best_level(catalog(results), "SGLang") == (
        f"{coverage.SIMULATED_NODES}, Kubernetes")


def test_no_run_means_every_cell_says_not_run(tmp_path):
    (tmp_path / "results").mkdir()
    table = coverage.coverage_table(catalog(tmp_path / "results"))
    assert (table[list(coverage.PLACES)] == coverage.NOT_RUN).all().all()
    assert coverage.best_level([], "vLLM") == coverage.NOT_RUN


def test_a_context_or_level_the_page_does_not_know_is_said_never_dropped(tmp_path):
    results = tmp_path / "results"
    make_run(results, "odd", "ssh", "2026-01-01", level="two hosts, one of them borrowed",
             serve="PASS", engine="vllm", served_file=True)
    runs = catalog(results)
    (covered,) = coverage.coverage(runs)
    assert covered.level == "not measured (ssh: two hosts, one of them borrowed)"
    assert covered.place == "ssh (a context this page does not know)"
    table = coverage.coverage_table(runs).set_index("engine / lane")
    assert table.columns[-1] == covered.place
    assert table.loc["vLLM", covered.place].startswith(f"**{covered.level}**: 1 run")


def test_the_committed_runs_fill_the_cells_of_the_places_they_ran_on():
    """Every engine x place cell of the committed runs, against what the run directories say
    (04's recorded engine, the run's context and hardware), read here without lib.publish's
    coverage: a cell says 'not run' exactly where no run served that engine there."""
    runs = catalog(REPO_ROOT / "results")
    served: dict[tuple[str, str], list[str]] = {}
    for run in runs:
        params = run.path / "04_serve" / "params.json"
        if not params.exists() or run.stages["04_serve"] not in ("PASS", "FAIL"):
            continue
        given = json.loads(params.read_text())
        engine = given.get("engine") or "transformers"
        context = given.get("plan_for") if run.context == "plan" else run.context
        place = {"kube": "Kubernetes", "slurm": "Slurm"}.get(
            context, "one GPU host" if "H200" in run.hardware else "one CPU host")
        served.setdefault((engines.ENGINES[engine].title, place), []).append(run.run_id)
    assert served, "no committed run served"
    table = coverage.coverage_table(runs).set_index("engine / lane")
    for engine in engines.ENGINES.values():
        for place in coverage.PLACES:
            said = table.loc[engine.title, place]
            ran = served.get((engine.title, place), [])
            if not ran:
                assert said == coverage.NOT_RUN, (engine.title, place)
                continue
            counted = sum(int(n) for n in re.findall(r"(\d+) runs?,", said))  # every level's
            assert counted == len(ran) and link(ran[-1]) in said, (engine.title, place, said)
    assert table.loc["vLLM", "Kubernetes"].startswith(f"**{coverage.SIMULATED_NODES}**")
    assert table.loc["vLLM", "one GPU host"].startswith("**measured**")
    for engine in ("SGLang", "TensorRT-LLM"):  # recorded on the plane, and planned for Slurm
        assert table.loc[engine, "Kubernetes"].startswith(f"**{coverage.SIMULATED_NODES}**")
        assert table.loc[engine, "Slurm"].startswith(f"**{coverage.RENDERED}**")


# ---- the page --------------------------------------------------------------------------------

def test_the_page_keeps_runs_figures_and_claims_in_tables_of_their_own(results):
    page = coverage.coverage_page(catalog(results), list(cited.CLAIMS))
    runs_part, rest = page.split("(cross-engine)=")
    figures_part, claims_part = rest.split("(claims)=")
    header = next(line for line in runs_part.splitlines() if line.startswith("| engine / lane"))
    assert header == "| engine / lane | " + " | ".join(coverage.PLACES) + " |"
    for claim in cited.CLAIMS:
        assert claim["claim"] not in runs_part and claim["claim"] in claims_part
        assert f"{claim['source']}, {claim['date']}" in claims_part
    assert "cited" not in "".join(line for line in runs_part.splitlines()
                                  if line.startswith("| "))
    for stack in published.cross_engine_figures()["stack"]:
        assert stack in figures_part and stack not in claims_part


# ---- the cross-engine figures, against their sources -------------------------------------------

# ANCHORS.md section 3, gates 2 to 4 (RESULTS.md), output tok/s at c4 / c8 / c32, 2026-07-07
ANCHORS_SECTION_3 = {
    "vLLM 0.24.0, EP_NUM_COMMS 1": (19.5, 38.8, 144.6),
    "vLLM 0.24.0, EP_NUM_COMMS 8 (the multicomm overlay)": (39.4, 76.5, 273.0),
    "SGLang 0.5.11 with a seam patch, EP_NUM_COMMS 8 (the overlay)": (34.5, 67.2, 255.2),
    "TensorRT-LLM 0.21.0 through an API shim": (66.5, 147.5, 586.7),
    "TensorRT-LLM 0.21.0 through a one-file native seam": (67.6, 142.4, 563.3),
}


def test_the_cross_engine_figures_are_the_sources_own():
    figures = published.cross_engine_figures().set_index("stack")
    assert {s: tuple(figures.loc[s, ["c4", "c8", "c32"]]) for s in figures.index} \
        == ANCHORS_SECTION_3
    assert set(figures["date"]) == {"2026-07-07"} and set(figures["source"]) == {
        published.SOURCE}
    assert set(figures["engine"]) <= set(engines.ENGINES)
    # RESULTS.md's own seam-against-shim deltas: c4 +1.7%, c8 -3.5%, c32 -4.0%
    shim = figures.loc["TensorRT-LLM 0.21.0 through an API shim", ["c4", "c8", "c32"]]
    seam = figures.loc["TensorRT-LLM 0.21.0 through a one-file native seam", ["c4", "c8", "c32"]]
    assert [round((b / a - 1) * 100, 1) for a, b in zip(shim, seam)] == [1.7, -3.5, -4.0]


def test_the_vllm_rows_match_the_reproductions_own_summaries():
    figures = published.cross_engine_figures().set_index("stack")
    for stack, path in VLLM_SUMMARIES.items():
        summary = json.loads((PUBLIC / path).read_text())
        if "cells" in summary and isinstance(summary["cells"], dict):  # t8's shape
            measured = {int(k.split("_")[0][1:]): v["agg_tok_s"]
                        for k, v in summary["cells"].items()}
        else:  # t3's shape
            measured = {c["concurrency"]: c["agg_tps"] for c in summary["aiperf"]["cells"]}
        for c in (4, 8, 32):
            assert figures.loc[stack, f"c{c}"] == round(measured[c], 1), (stack, c)


def test_each_cross_engine_row_says_its_level_and_what_the_guide_reached(results):
    runs = catalog(results)
    table = coverage.cross_engine_table(runs).set_index("engine, stack")
    assert set(table["level"]) == {f"cited: {published.SOURCE}, 2026-07-07"}
    assert table.loc["vLLM 0.24.0, EP_NUM_COMMS 1", "this guide"] == "measured, one GPU host"
    assert table.loc["SGLang 0.5.11 with a seam patch, EP_NUM_COMMS 8 (the overlay)",
                     "this guide"] == f"{coverage.SIMULATED_NODES}, Kubernetes"
    assert table.loc["TensorRT-LLM 0.21.0 through an API shim", "this guide"] == (
        f"{coverage.SLURM_SIMULATED_GPUS}, Slurm")
    assert table.loc["TensorRT-LLM 0.21.0 through an API shim", "c32 tok/s"] == "586.7"


# ---- megatron-core training (07) and NeMo-RL ------------------------------------------------------

def add_training(run: Path, state: str, ranks: int | None) -> None:
    """07's gates (one gate in `state`) and, where `ranks` is given, two steps logged by as many
    ranks: the files lib.stages.train writes."""
    write_json(run / "07_train" / "gates.json", gates(state))
    if ranks is not None:
        write_json(run / "07_train" / "steps.json", [
            {"step": i, "loss": 5.0 - i, "grad norm": 1.0, "ranks": ranks,
             "sent to other ranks": 0, "routed to other ranks": 0, "step s (slowest rank)": 0.1}
            for i in range(2)])


def test_the_training_lane_names_each_place_its_level_and_ep(results):
    add_training(results / "gpu-a", "PASS", ranks=1)
    add_training(results / "gpu-b", "FAIL", ranks=1)
    add_training(results / "cpu-a", "PASS", ranks=2)
    add_training(results / "plan-a", "SKIP", ranks=None)  # planned for Slurm: rendered only
    add_training(results / "kube-skip", "SKIP", ranks=None)  # the place could not: nothing
    table = coverage.coverage_table(catalog(results)).set_index("engine / lane")
    lane = table.loc[coverage.TRAINING_LANE]
    assert lane["one GPU host"] == f"**measured**: 2 runs, 1 passing; EP 1; latest {link('gpu-b')}"
    assert lane["one CPU host"] == f"**measured**: 1 run, 1 passing; EP 2; latest {link('cpu-a')}"
    assert lane["Slurm"] == f"**{coverage.RENDERED}**: 1 run, 0 passing; latest {link('plan-a')}"
    assert lane["Kubernetes"] == coverage.NOT_RUN
    assert coverage.best_level(catalog(results), coverage.TRAINING_LANE) == "measured, one GPU host"
    # the serving lanes of the same runs are as before: an EP is said only where 07 ran
    assert table.loc["vLLM", "one GPU host"] == (f"**measured**: 2 runs, 1 passing; latest "
                                                f"{link('gpu-b')}")


def test_the_committed_training_runs_fill_the_training_row():
    runs = catalog(REPO_ROOT / "results")
    lane = coverage.coverage_table(runs).set_index("engine / lane").loc[coverage.TRAINING_LANE]
    assert lane["one GPU host"] == ("**measured**: 2 runs, 1 passing; EP 1; latest "
                                    f"{link('gpu-1xh200-train-20261204b')}")
    ran_07 = {coverage.place_of(r) for r in runs if r.stages.get("07_train") != "not run"}
    for place in coverage.PLACES:
        assert (lane[place] == coverage.NOT_RUN) == (place not in ran_07), place


def test_the_nemo_rl_row_is_run_nowhere_and_its_section_says_why(results):
    runs = catalog(results)
    row = coverage.coverage_table(runs).set_index("engine / lane").loc[coverage.NEMO_RL_LANE]
    assert set(row) == {coverage.NOT_RUN}
    page = coverage.coverage_page(runs, list(cited.CLAIMS))
    section = page.split("(nemo-rl)=", 1)[1]
    assert section.startswith("\n## NeMo-RL: not run here, and why")
    for said in ("not a NeMo-RL run", "rollout-shaped driver over Megatron's fused all-to-all",
                 "V1-to-V2 shim", "64 tokens", "[64, 8192]", "9.45 s", "as a follow-up",
                 "results/nemo-rl-rollout-20260429/VALIDATION.md, 2026-04-29"):
        assert said in coverage.NEMO_RL_RAN and said in section, said
    header = next(line for line in section.splitlines() if line.startswith("| fact"))
    assert header == f"| fact | source, date | checked here, {coverage.NEMO_RL_CHECKED} |"
    facts = {f["fact"]: f for f in coverage.NEMO_RL_FACTS}
    assert set(facts) == {
        "NeMo-RL's main requires Python >= 3.13.14", "ray >= 2.55.1",
        "Transformer Engine and vLLM come from outside the registries",
        "PyPI's nemo-rl is a placeholder",
        "the public reproduction's pin 46be4e8 needs torch 2.9.0 (the guide's GPU image has "
        "torch 2.11.0)"}
    for fact in facts.values():  # each with its source and date, and what was checked, said
        assert re.search(r"\d{4}-\d{2}-\d{2}|PyPI", fact["source, date"]), fact
        assert re.match(r"(verified|partly|not verified|at NeMo-RL commit)", fact["checked here"])
        assert fact["fact"] in section and fact["checked here"] in section
    assert facts["PyPI's nemo-rl is a placeholder"]["checked here"].startswith("verified: one "
                                                                              "version, 0.0.0")
    assert "No placeholder stage" in coverage.NEMO_RL_WHY and coverage.NEMO_RL_WHY in section


def test_the_nemo_rl_record_says_what_the_section_says():
    record = (PUBLIC / "nemo-rl-rollout-20260429" / "VALIDATION.md").read_text()
    assert "NeMo-RL rollout: PASS on 2-node H100 EFA — 2026-04-29" in record
    assert "NEMO-RL ROLLOUT SMOKE PASS in 9.45s" in record
    assert "tokens.shape=[64]  log_probs.shape=[64, 8192]" in record
    assert "with the V1->V2 shim" in record and "is\na follow-up" in record
    assert "nemo-rl-deepep-v2:46be4e8-shim-h100-20260429" in record
