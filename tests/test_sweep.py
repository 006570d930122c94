"""lib.sweep and stage 05 for real: AIPerf 0.13 against the real local server."""
from __future__ import annotations

import gzip
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from lib.measure import aiperf as aiperf_export
from lib.core import evidence
from lib.engines import models
from lib.stages import ab, registry as params
from lib.engines import server as served
from lib.measure import sweep
from lib.core.door import Door, read_transcript
from lib.core.evidence import skip
from lib.core.stage import Stage
from lib.stages import serve as serve_stage
from lib.stages import sweep as sweep_stage

# prompt_corpus random: no 5 MB corpus tokenized at each cell's start (lib.measure.sweep)
SMALL = {"concurrency": [2], "repeats": 1, "request_count": 6, "warmup_requests": 1,
         "prompt_corpus": "random"}


def make_stage(run_dir: Path, name: str, given: dict | None = None) -> Stage:
    p = params.resolve(name, given or {})
    return Stage(name, p, run_dir, Door(run_dir, name), None)


# ---- the argv builder ----------------------------------------------------------------------------
def _argv(engine="transformers", **kw):
    base = dict(engine=engine, model_dir="/m", url="http://127.0.0.1:5", concurrency=4,
                request_count=16, warmup_requests=2, input_tokens=64, output_tokens=16, seed=7,
                artifact_dir="/a")
    base.update(kw)
    return sweep.aiperf_argv(**base)


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def test_argv_transformers_forces_length_with_min_new_tokens():
    argv = _argv()
    assert argv[:5] == ["env", "-u", "HF_HUB_OFFLINE", "-u", "TRANSFORMERS_OFFLINE"]
    assert argv[5].endswith("aiperf") and argv[6] == "profile"
    extra = json.loads(_flag(argv, "--extra-inputs"))
    assert json.loads(extra["generation_config"]) == {"min_new_tokens": 16}
    assert "ignore_eos" not in _flag(argv, "--extra-inputs")
    for flag, value in (("--model", "/m"), ("--tokenizer", "/m"), ("--url", "http://127.0.0.1:5"),
                        ("--endpoint-type", "chat"), ("--concurrency", "4"),
                        ("--request-count", "16"), ("--warmup-request-count", "2"),
                        ("--synthetic-input-tokens-mean", "64"), ("--output-tokens-mean", "16"),
                        ("--random-seed", "7"), ("--artifact-dir", "/a")):
        assert _flag(argv, flag) == value, flag
    for flag in ("--streaming", "--use-server-token-count", "--no-server-metrics"):
        assert flag in argv


def test_argv_vllm_takes_ignore_eos_and_pinning():
    argv = _argv("vllm", cores="1", warmup_requests=0)
    assert argv[:3] == ["taskset", "-c", "1"]
    assert json.loads(_flag(argv, "--extra-inputs")) == {"ignore_eos": True}
    assert "--warmup-request-count" not in argv


def test_argv_names_a_prompt_corpus_only_when_it_is_not_aiperfs_default():
    """The image's AIPerf 0.10.0 has no --prompt-corpus and reads Shakespeare: the default
    argv must run there unchanged; another corpus is named after the input shape."""
    assert "--prompt-corpus" not in _argv()
    assert "--prompt-corpus" not in _argv(prompt_corpus=sweep.DEFAULT_PROMPT_CORPUS)
    for corpus in ("coding", "random"):
        argv = _argv(prompt_corpus=corpus)
        assert _flag(argv, "--prompt-corpus") == corpus
        assert argv.index("--prompt-corpus") == argv.index("--synthetic-input-tokens-mean") + 2


def test_prompt_corpus_is_refused_on_a_cluster_place_naming_the_images_aiperf():
    """coding or random on kube, slurm or a plan (the image's AIPerf runs the cells there) is
    refused before any effect, naming the pinned version; sonnet is taken everywhere."""
    from lib.core.errors import ParameterError
    from lib.roots import pins as pins_mod

    image = pins_mod.load()["pins"]["aiperf_public"]["version"]
    for context in ("kube", "slurm", "plan"):
        assert params.resolve("05_sweep", {"context": context})["prompt_corpus"] == "sonnet"
        with pytest.raises(ParameterError) as refused:
            params.resolve("05_sweep", {"context": context, "prompt_corpus": "random"})
        assert refused.value.name == "prompt_corpus"
        assert f"sonnet on a cluster place: its AIPerf is the image's {image}" \
            in str(refused.value)
    assert params.resolve("06_multicomm", {"prompt_corpus": "coding"})["prompt_corpus"] == "coding"


def test_env_never_sets_offline():
    env = sweep.aiperf_env("/x")
    assert env["HF_ENDPOINT"] == "http://127.0.0.1:9"
    assert env["AIPERF_DATASET_MMAP_BASE_PATH"] == "/x"
    assert "HF_HUB_OFFLINE" not in env and "TRANSFORMERS_OFFLINE" not in env


def test_cells_interleave_by_repeat_and_folders_follow_lib_aiperf(tmp_path):
    cells = sweep.plan_cells([1, 2, 4], 2)
    assert [(c.repeat, c.concurrency) for c in cells] == [
        (1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4)]
    stage = make_stage(tmp_path / "run", "05_sweep")
    folder = sweep.cell_dir(stage, cells[4], "transformers")
    assert folder.relative_to(stage.dir).as_posix() == "aiperf/repeat_2/aiperf-transformers-c2"
    assert aiperf_export.infer_repeat(folder) == 2
    assert aiperf_export.infer_arm(folder) == "transformers"
    assert sweep.cell_timeout_s(16, 2, 16, 1) > sweep.cell_timeout_s(16, 2, 16, 4)


# ---- SKIP paths ----------------------------------------------------------------------------------
def test_skips_every_cell_without_04(tmp_path):
    stage = make_stage(tmp_path / "run", "05_sweep")
    data = sweep_stage.run(stage)
    assert "04_serve has no gates" in data["skipped"]
    assert len(stage.gates) == 9 and {g.status for g in stage.gates} == {"SKIP"}
    sweep_stage.show(stage, data)


def test_skips_every_cell_when_04_failed(tmp_path):
    run_dir = tmp_path / "run"
    evidence.write_json_new(run_dir / "04_serve" / "gates.json", [
        {"gate": "server ready", "status": "FAIL", "observed": None, "expected": None,
         "reason": "x", "evidence": []}])
    stage = make_stage(run_dir, "05_sweep", {"concurrency": "1,2", "repeats": 2})
    sweep_stage.run(stage)
    assert len(stage.gates) == 4 and {g.status for g in stage.gates} == {"SKIP"}
    assert all("04_serve FAILED" in g.reason and "server ready" in g.reason for g in stage.gates)


def test_a_sweep_after_a_serve_that_measured_nothing_skips(tmp_path):
    """04 on a place that cannot serve records SKIPs only; 05 then measures nothing, saying
    why, and starts nothing."""
    s04 = make_stage(tmp_path / "run", "04_serve", {"context": "slurm"})
    # what 04 records where its place cannot serve (the slurm place without an image or a venv,
    # once its cluster answered: tests/test_slurm_place.py)
    s04.add(*[skip(name, "the slurm place runs servers with an `image` or a `venv`; neither is "
                         "given") for name in serve_stage.CLUSTER_GATES])
    s04.finish()
    stage = make_stage(tmp_path / "run", "05_sweep", {"context": "slurm"})
    sweep_stage.run(stage)
    assert {g.status for g in stage.gates} == {"SKIP"}
    assert all("04_serve passed no gate in this run (all SKIP)" in g.reason for g in stage.gates)
    calls = read_transcript(tmp_path / "run" / "transcript.jsonl")
    assert [e for e in calls if e["stage"] == "05_sweep"] == []  # 05 asked nothing


# ---- real AIPerf ---------------------------------------------------------------------------------
def test_stage_05_measures_and_replays(tmp_path, monkeypatch):
    """Real 04, then a real one-level sweep (its own server), then a replay of 05."""
    run_dir = tmp_path / "run"
    s04 = make_stage(run_dir, "04_serve")
    serve_stage.run(s04)
    s04.finish()
    stage = make_stage(run_dir, "05_sweep", SMALL)
    from tests.vllm_stage_kit import spy_on_the_loop

    loops = spy_on_the_loop(monkeypatch)
    data = sweep_stage.run(stage)
    assert loops == [("05_sweep", ("transformers",))]  # the one loop, with one arm
    sweep_stage.show(stage, data)
    stage.finish()
    gates = evidence.read_gates(stage.dir)
    failed = [g for g in gates if g["status"] != "PASS"]
    assert not failed, failed
    names = {g["gate"] for g in gates}
    for expected in ("aiperf transformers c2 repeat 1: AIPerf exit 0",
                     "aiperf transformers c2 repeat 1: zero request errors",
                     "aiperf transformers c2 repeat 1: completed == requested",
                     "aiperf transformers c2 repeat 1: not cancelled",
                     "server resident memory under 1.5 GiB", "warmup excluded from every cell",
                     "server ready", "server stopped", "the same model 04_serve served"):
        assert expected in names, expected

    # warmup_requests 1 at concurrency 2: the cell warmed up with one full batch, 2 requests
    [aiperf] = [e["key"] for e in read_transcript(run_dir / "transcript.jsonl")
                if e["stage"] == "05_sweep" and e["kind"] == "run" and "profile" in e["key"]]
    assert aiperf[aiperf.index("--warmup-request-count") + 1] == "2"
    assert aiperf[aiperf.index("--prompt-corpus") + 1] == "random"

    # AIPerf's per-request records are kept whole, gzipped (no reader uses them)
    cell = next((stage.dir / "aiperf").rglob("profile_export.jsonl.gz")).parent
    assert not list((stage.dir / "aiperf").rglob("profile_export.jsonl"))
    records = gzip.decompress((cell / "profile_export.jsonl.gz").read_bytes()).splitlines()
    assert len(records) >= 6 and all(json.loads(r) for r in records)

    summary = pd.read_csv(stage.dir / "summary.csv")
    assert list(summary.columns) == list(aiperf_export.SUMMARY_COLUMNS)
    row = summary.iloc[0]
    assert (row["arm"], row["concurrency"], row["repeat"]) == ("transformers", 2, 1)
    # 6 asked, at least requests_per_slot (5) per slot at concurrency 2: AIPerf was asked for 10
    assert row["errors"] == 0 and row["requests_completed"] == 10 == row["requests_requested"]
    assert row["output_tps"] > 0 and row["output_tokens_mean"] == 16
    assert not str(row["source"]).startswith("/")  # run-relative, so a replay shows the same
    assert json.loads((stage.dir / "summary.json").read_text())[0]["errors"] == 0
    for png in ("throughput.png", "latency.png"):
        assert (stage.dir / png).read_bytes()[:4] == b"\x89PNG"
    assert not (stage.dir / sweep.MMAP_FOLDER).exists()
    memory = json.loads((stage.dir / "memory.json").read_text())
    assert 0 < memory["after_cell"][0]["rss_bytes"] < sweep.RSS_LIMIT_BYTES

    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    replay = Stage("05_sweep", stage.params, copy, Door(copy, "05_sweep", replay=True), run_dir)
    started = time.monotonic()
    again = sweep_stage.run(replay)
    replay.finish()  # compares gates.json; summary.csv/json were compared on write
    assert time.monotonic() - started < 10.0
    assert [g.as_dict() for g in replay.gates] == gates
    pd.testing.assert_frame_equal(again["summary"], data["summary"])


def test_failed_requests_give_an_error_row_and_failing_gates(tmp_path):
    """AIPerf against a port where nothing listens: every request fails, no summary export."""
    model_dir = models.build(0)["model_dir"]
    stage = make_stage(tmp_path / "run", "05_sweep",
                       {"concurrency": [1], "repeats": 1, "request_count": 3,
                        "requests_per_slot": 0, "warmup_requests": 0})
    port = stage.door.free_port()
    nowhere = served.Server(model_dir, port, stage.path("server.log"))
    cell = sweep.Cell(1, 1)
    plan = ab.sweep_plan(stage.params, 1)
    run = sweep.run_cell(stage, nowhere, cell, plan, plan.shapes[0], engine="transformers",
                         mmap_dir=stage.path(sweep.MMAP_FOLDER))
    assert run.rc != 0
    frame = sweep.summary_table(stage, [cell], "transformers", 3)
    row = frame.iloc[0]
    assert row["errors"] == 3 and row["requests_completed"] == 0
    assert not row["has_export"]
    statuses = {g.gate.split(": ", 1)[1]: g.status for g in sweep.cell_gates(frame)}
    assert statuses["summary export written"] == "FAIL"
    assert statuses["zero request errors"] == "FAIL"
    assert statuses["completed == requested"] == "FAIL"
    assert sweep.exit_gate(run, "transformers").status == "FAIL"
    assert "failed" in sweep.exit_gate(run, "transformers").reason


def test_a_cell_without_artifacts_still_gets_a_row(tmp_path):
    stage = make_stage(tmp_path / "run", "05_sweep")
    frame = sweep.summary_table(stage, [sweep.Cell(1, 4)], "transformers", 16)
    assert list(frame.columns) == list(aiperf_export.SUMMARY_COLUMNS)
    row = frame.iloc[0]
    assert (row["concurrency"], row["repeat"], row["requests_requested"]) == (4, 1, 16)
    gates = {g.gate.split(": ", 1)[1]: g.status for g in sweep.cell_gates(frame)}
    assert gates["summary export written"] == "FAIL"
    assert gates["completed == requested"] == "FAIL"


def test_rss_gate():
    run = sweep.CellRun(sweep.Cell(1, 1), 0, False, 1.0, "", [], 2 * 2 ** 30)
    assert sweep.rss_gate([run], 100, []).status == "FAIL"
    run.rss_bytes = 700 * 2 ** 20
    assert sweep.rss_gate([run], 600 * 2 ** 20, []).status == "PASS"
    assert sweep.rss_gate([], None, []).status == "FAIL"


def test_metric_total_sums_every_engine_and_ignores_lookalikes():
    from lib.measure.sweep import GENERATION_TOKENS, metric_total

    text = ("# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
            "# TYPE vllm:generation_tokens_total counter\n"
            'vllm:generation_tokens_total{engine="0",model_name="m"} 1280.0\n'
            'vllm:generation_tokens_total{engine="1",model_name="m"} 1152.0\n'
            'vllm:generation_tokens_total_created{engine="0"} 1.7e9\n')
    assert metric_total(text, GENERATION_TOKENS) == 2432.0
    assert metric_total("", GENERATION_TOKENS) is None


def test_token_count_gates_fail_when_vllm_counted_less():
    from lib.measure.sweep import Cell, CellRun, token_count_gates

    def run(before, after):
        r = CellRun(Cell(1, 4), 0, False, 1.0, "", [], None)
        r.metrics = ({"file": "b", "status": 200, "generation_tokens": before},
                     {"file": "a", "status": 200, "generation_tokens": after})
        return r

    ok, short = token_count_gates([run(0, 48 * 128 + 8 * 128), run(100, 100 + 47 * 128)],
                                  48, 128, "vllm")
    assert ok.status == "PASS" and ok.observed == 56 * 128
    assert short.status == "FAIL" and short.expected == f">= {48 * 128}"
    unread = CellRun(Cell(1, 8), 0, False, 1.0, "", [], None)
    unread.metrics = ({"file": None, "status": 500, "generation_tokens": None},) * 2
    assert token_count_gates([unread], 48, 128, "vllm")[0].status == "FAIL"


def test_the_aiperf_shim_hides_torch_from_transformers_tokenizers():
    """scripts/aiperf_no_torch (gpu-run.sh's AIPerf wrapper): with torch installed (this venv
    has the CPU build), transformers' tokenizer side imports without torch, and other packages
    still import; without the shim the same import pulls torch in."""
    import subprocess
    import sys

    from lib.core.door import REPO_ROOT

    probe = ("import sys, importlib.util, numpy; from transformers import AutoTokenizer; "
             "print('torch' in sys.modules, importlib.util.find_spec('torch') is None)")
    shim = str(REPO_ROOT / "scripts" / "aiperf_no_torch")
    env = {"PATH": "/usr/bin:/bin"}
    hidden = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            env={**env, "PYTHONPATH": shim}, check=True)
    plain = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           env=env, check=True)
    assert hidden.stdout.split() == ["False", "True"], hidden.stderr
    assert plain.stdout.split() == ["True", "False"], plain.stderr


def test_a_cell_warms_up_with_at_least_one_full_batch():
    """8 warmup requests cannot form a batch of 32; with warmup_full_batch each cell's warmup is
    raised to its concurrency (and its timeout counts them); without it, as given. The plan is the stage's (lib.stages.ab.sweep_plan)."""
    p = params.resolve("05_sweep", {"engine": "vllm", "warmup_requests": 8,
                                    "warmup_full_batch": True})
    plan = ab.sweep_plan(p, p["repeats"])
    assert [plan.warmup(c) for c in (4, 8, 32)] == [8, 8, 32]
    assert [replace(plan, warmup_full_batch=False).warmup(c) for c in (4, 8, 32)] == [8, 8, 8]
    none = ab.sweep_plan(params.resolve("05_sweep", {"warmup_requests": 0,
                                                     "warmup_full_batch": False}), 1)
    assert none.warmup(32) == 0


def test_aiperf_exit_error_box_becomes_one_plain_line():
    """What AIPerf 0.13 printed on 2x H200 when every request failed (its server had died; run
    gpu-2xh200-deepep-vllm-20261130d): a coloured box, unwrapped to one line without the
    terminal's escape codes, the reason and the log file kept."""
    from lib.core.door import REPO_ROOT

    recorded = (REPO_ROOT / "results" / "gpu-2xh200-deepep-vllm-20261130d" / "calls"
                / "06_multicomm" / "2454.stdout").read_text()
    assert "\x1b[1;31m" in recorded
    tail = sweep._tail(recorded)
    assert "\x1b" not in tail and "\n" not in tail and "│" not in tail
    assert tail.startswith("Exit Errors")
    assert "Reason: All 48 inference request(s) failed." in tail
    assert tail.endswith("aiperf-vllm-graphs-ep-c4/logs/aiperf.log")


def test_a_cell_measures_at_least_requests_per_slot_times_its_concurrency():
    """The public review's 5x requests per level: at the vLLM defaults (48 requests) c4 and c8
    keep 48 and c32 measures 160, five waves instead of one and a half; 0 turns it off."""
    p = params.resolve("05_sweep", {"engine": "vllm"})
    assert p["requests_per_slot"] == 5 and p["request_count"] == 48
    plan = ab.sweep_plan(p, p["repeats"])
    assert plan.concurrency == (4, 8, 32) and plan.repeats == p["repeats"] == 3
    assert [plan.requests(c) for c in (4, 8, 32)] == [48, 48, 160]
    assert plan.requests_said() == "48 / 48 / 160 (at concurrency 4 / 8 / 32)"
    off = ab.sweep_plan(params.resolve("05_sweep", {"engine": "vllm", "requests_per_slot": 0}),
                        p["repeats"])
    assert [off.requests(c) for c in (4, 8, 32)] == [48, 48, 48]
    assert off.requests_said() == "48"
    with pytest.raises(params.ParameterError, match="requests_per_slot"):
        params.resolve("05_sweep", {"requests_per_slot": -1})
    argv = sweep.aiperf_argv(engine="vllm", model_dir="m", url="http://127.0.0.1:1",
                             concurrency=32, request_count=plan.requests(32),
                             warmup_requests=32, input_tokens=120, output_tokens=128, seed=0,
                             artifact_dir="a", cores=None)
    assert argv[argv.index("--request-count") + 1] == "160"
