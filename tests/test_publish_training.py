"""The results page's training section (lib.publish.training, its data lib.publish.results): the
committed one-H200 runs' losses read from their evidence, the FAILed run shown as a FAIL naming
its gate, the plot written with its data, which runs are shown (small runs written here), and
the cited public gate 5 against its own record."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from lib.core import evidence
from lib.core.door import REPO_ROOT
from lib.publish import pages, plots, training
from lib.publish import results as figures
from lib.publish.catalog import END_TO_END, catalog

RESULTS = REPO_ROOT / "results"
PASSED = "gpu-1xh200-train-20261204b"   # lr 3e-4: 8 steps, loss 8.7281 -> 7.0767
DIVERGED = "gpu-1xh200-train-20261204"  # lr 3e-3: 5 steps, loss 8.7281 -> 9.6163, a FAIL
FALLS = "loss lower after the last step than after the first"
PUBLIC = REPO_ROOT.parent / "shared" / "fixtures" / "public-repro" / "results"


@pytest.fixture(scope="module")
def committed():
    return catalog(RESULTS)


@pytest.fixture(scope="module")
def summary(committed):
    return figures.training_summary(committed).set_index("run")


def test_the_committed_gpu_runs_rows_are_read_from_their_evidence(summary):
    passed, diverged = summary.loc[PASSED], summary.loc[DIVERGED]
    assert round(passed["first_loss"], 4) == 8.7281 and round(passed["last_loss"], 4) == 7.0767
    assert (passed["ep"], passed["steps"], passed["state"]) == (1, 8, "PASS")
    assert passed["failed_gates"] == [] and passed["level"] == END_TO_END
    assert passed["hardware"] == "1x NVIDIA H200, one host"
    assert (passed["crossing_min"], passed["crossing_max"]) == (0, 0)  # EP 1: none can cross
    assert round(diverged["last_loss"], 4) == 9.6163 and diverged["steps"] == 5
    assert diverged["state"] == "FAIL" and diverged["failed_gates"] == [FALLS]
    # the same numbers as each run's own gate recorded them
    for run_id in (PASSED, DIVERGED):
        gates = json.loads((RESULTS / run_id / "07_train" / "gates.json").read_text())
        recorded = next(g for g in gates if g["gate"] == "loss finite at every step")["observed"]
        row = summary.loc[run_id]
        assert [round(row["first_loss"], 4), round(row["last_loss"], 4)] == [recorded[0],
                                                                             recorded[-1]]


def test_the_table_shows_the_failed_run_as_a_fail_naming_its_gate(summary):
    table = training.training_table(summary.reset_index(), pages.run_link).set_index("run")
    passed, diverged = table.loc[pages.run_link(PASSED)], table.loc[pages.run_link(DIVERGED)]
    assert passed["07"] == "PASS" and passed["loss first -> last"] == "8.7281 -> 7.0767"
    assert diverged["07"] == f"FAIL: {FALLS}"
    assert diverged["loss first -> last"] == "8.7281 -> 9.6163"
    assert passed["token copies crossing ranks per step"] == "0 (EP 1: none can cross)"
    assert list(table.columns) == ["hardware", "EP", "steps", "loss first -> last",
                                   "token copies crossing ranks per step", "07", "level"]
    public = table.loc["the public reproduction's gate 5"]
    assert public["loss first -> last"] == "26.41 -> 24.61"
    assert public["level"] == "cited, 2026-05-05 (its source below the table)"


def test_the_plot_is_written_with_the_steps_it_drew(committed, tmp_path):
    steps = figures.training_steps(committed)
    png = plots.training_plot(steps, tmp_path)
    assert png == tmp_path / "training.png" and png.stat().st_size > 10_000
    drawn = pd.read_csv(tmp_path / "training.csv")
    mine = drawn[drawn["run"].isin([PASSED, DIVERGED])]
    assert mine.groupby("run").size().to_dict() == {PASSED: 8, DIVERGED: 5}
    recorded = json.loads((RESULTS / PASSED / "07_train" / "steps.json").read_text())
    assert list(mine[mine["run"] == PASSED]["loss"]) == [s["loss"] for s in recorded]
    assert list(mine[mine["run"] == PASSED]["grad_norm"]) == [s["grad norm"] for s in recorded]
    assert set(mine[mine["run"] == DIVERGED]["state"]) == {"FAIL"}


def test_the_section_cites_the_public_gate_beside_the_runs(committed, tmp_path):
    section = "\n".join(training.training_section(committed, tmp_path, pages.run_link))
    assert "## 5. Does a training step's all-to-all work?" in section
    assert f"![{plots.training_spec(figures.training_steps(committed)).alt}](figures/training.png)" \
        in section
    assert (tmp_path / "training.png").exists()
    assert f"| FAIL: {FALLS} |" in section and "8.7281 -> 7.0767" in section
    assert "loss 26.41 -> 25.10 -> 24.61, grad norm 30.64 -> 28.20 -> 27.09, EFA TX 1.096 GB" \
        in section
    assert "results/megatron-shapeY-20260505/VALIDATION.md, 2026-05-05; cited" in section
    assert "compare the curves' shape, not their values" in section
    shown = figures.training_summary(committed)
    assert f"{len(shown)} runs shown, {int((shown['state'] == 'PASS').sum())} passing" in section


def test_the_landing_answer_names_the_run_its_level_and_the_fail(committed):
    answer = " ".join(training.training_answer(committed, pages.run_link))
    assert answer.startswith("**Yes on 1x NVIDIA H200, one host, EP 1**")
    assert f"loss 8.73 -> 7.08 ({END_TO_END}, {pages.run_link(PASSED)})" in answer
    assert "no token crosses a GPU at EP 1" in answer
    assert f"1 run FAILed 07 ('{FALLS}')" in answer
    assert "cited: loss 26.41 -> 25.10 -> 24.61" in answer
    assert ("trains", "Does a training step's all-to-all work?") in pages.QUESTIONS


def test_the_public_gate5_figures_are_its_records_own():
    record = (PUBLIC / "megatron-shapeY-20260505" / "VALIDATION.md").read_text()
    logged = re.findall(r"STEP \d/3 loss=([\d.]+) grad_norm=([\d.]+)", record)
    assert tuple(float(loss) for loss, _ in logged) == training.PUBLIC_GATE5["loss"]
    assert tuple(float(norm) for _, norm in logged) == training.PUBLIC_GATE5["grad_norm"]
    tx = int(re.search(r"EFA tx_bytes delta: (\d+) bytes", record).group(1))
    assert tx == training.PUBLIC_GATE5["efa_tx_bytes"]
    assert "**Date**: 2026-05-05" in record and training.PUBLIC_GATE5["date"] == "2026-05-05"
    assert "hidden=2048, ffn=1024, 128 experts top-8" in record


# ---- which runs are shown: small runs written here ---------------------------------------------

def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")


def train_run(results: Path, run_id: str, *, context: str = "local", gpus: int = 0,
              level: str = "", state: str = "PASS", losses=(4.86, 4.71, 4.43),
              ranks: int = 2, crossing=(506, 510, 516)) -> None:
    """A run directory as the guide writes one, with 07's gates and steps.json, sealed."""
    record = {"run_id": run_id, "context": context, "created_utc": "2026-01-01T00:00:00",
              "parameters": {"context": context}, **({"level": level} if level else {})}
    write_json(results / run_id / "run.json", record)
    write_json(results / run_id / "00_cluster" / "host.json",
               {"cpu_cores": 2, "gpus": [{"name": "NVIDIA H200"}] * gpus})
    gates = [{"gate": "every rank exits 0", "status": "PASS"},
             {"gate": FALLS, "status": state}]
    write_json(results / run_id / "07_train" / "gates.json",
               [{**g, "observed": None, "expected": None, "reason": "", "evidence": []}
                for g in gates])
    write_json(results / run_id / "07_train" / "steps.json", [
        {"step": i, "loss": loss, "grad norm": 1.0, "ranks": ranks,
         "sent to other ranks": sent, "routed to other ranks": sent, "step s (slowest rank)": 0.1}
        for i, (loss, sent) in enumerate(zip(losses, crossing))])
    evidence.seal(results / run_id)  # a run's figures are shown only with its seal intact


def test_the_cpu_reference_is_shown_at_its_own_level_and_no_other_cpu_run(tmp_path):
    results = tmp_path / "results"
    train_run(results, "cpu-ref")
    train_run(results, "cpu-older")  # a CPU run, not the reference: the appendix's
    train_run(results, "gpu-tampered", gpus=1, ranks=1)
    (results / "gpu-tampered" / "07_train" / "steps.json").write_text("[]")  # after sealing
    train_run(results, "kube-sim", context="kube", level="control plane real, nodes simulated")
    train_run(results, "gpu-one", gpus=1, ranks=1, crossing=(0, 0, 0),
              losses=(8.7, 8.4, 9.1), state="FAIL")
    (results / "REFERENCE").write_text("cpu-ref\n")
    summary = figures.training_summary(catalog(results)).set_index("run")
    assert sorted(summary.index) == ["cpu-ref", "gpu-one"]
    cpu = summary.loc["cpu-ref"]
    assert cpu["level"] == figures.CPU_TRAINING == "measured here, CPU, tiny model"
    assert (cpu["ep"], cpu["crossing_min"], cpu["crossing_max"]) == (2, 506, 516)
    assert (cpu["first_loss"], cpu["last_loss"]) == (4.86, 4.43)
    assert summary.loc["gpu-one", "failed_gates"] == [FALLS]
    table = training.training_table(summary.reset_index(), pages.run_link).set_index("run")
    assert table.loc[pages.run_link("cpu-ref"), "token copies crossing ranks per step"] \
        == "506 to 516"
    answer = " ".join(training.training_answer(catalog(results), pages.run_link))
    assert answer.startswith("On GPUs: not measured (no passing 07 on real GPUs)")
    assert (f"On CPU, EP 2 over gloo: loss 4.86 -> 4.43, 506 to 516 token copies crossing ranks "
            f"per step ({figures.CPU_TRAINING}, {pages.run_link('cpu-ref')})") in answer


def test_an_unsealed_gpu_reference_is_not_shown_as_the_cpu_run(tmp_path):
    results = tmp_path / "results"
    train_run(results, "gpu-ref", gpus=1, ranks=1, crossing=(0, 0, 0))
    (results / "gpu-ref" / evidence.SUMS_NAME).unlink()  # interrupted before it was sealed
    (results / "REFERENCE").write_text("gpu-ref\n")
    assert figures.training_summary(catalog(results)).empty


def test_no_run_of_07_says_not_measured_and_draws_nothing(tmp_path):
    results = tmp_path / "results"
    train_run(results, "cpu-not-reference")
    section = "\n".join(training.training_section(catalog(results), tmp_path / "fig",
                                                  pages.run_link))
    assert "not measured: no committed run that may be shown here ran 07." in section
    assert not (tmp_path / "fig" / "training.png").exists()
    assert "the public reproduction's gate 5" in section  # the cited row stays


def test_the_committed_reference_run_shows_its_07_at_the_cpu_level(committed):
    reference = (RESULTS / "REFERENCE").read_text().strip()
    run = next(r for r in committed if r.run_id == reference)
    if run.stages.get("07_train") not in ("PASS", "FAIL"):
        pytest.skip(f"the reference run {reference} was recorded before 07 existed")
    row = figures.training_summary(committed).set_index("run").loc[reference]
    assert row["level"] == figures.CPU_TRAINING and row["ep"] == 2
    assert row["crossing_min"] > 0 and row["last_loss"] < row["first_loss"]
