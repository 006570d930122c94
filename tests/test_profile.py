"""The cluster profile (lib.stages.profile): written once, checked by the stages' own rules, the
notebooks' defaults with an explicit -p winning, recorded in run.json, never read by a replay.
The headline command runs for real here through papermill on the `plan` context (a profile of
context plan: nothing is applied; tests/test_profile_kube.py runs it on the control plane)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lib import runner
from lib.stages import profile
from lib.core.door import REPO_ROOT
from lib.core.errors import ParameterError

IMAGE = "registry.example/deepep-v2@sha256:" + "a" * 64


@pytest.fixture
def profile_path(tmp_path, monkeypatch):
    where = tmp_path / "profile.yaml"
    monkeypatch.setenv(profile.PROFILE_ENV, str(where))
    return where


def test_written_from_the_command_line_checked_and_shown(profile_path, capsys):
    assert runner.main(["profile", "--context", "kube", "-p", "kube_context", "my-eks", "-p",
                        "namespace", "deepep", "-p", "image", IMAGE, "-p", "nodes", "4"]) == 0
    assert yaml.safe_load(profile_path.read_text()) == {
        "context": "kube", "kube_context": "my-eks", "namespace": "deepep", "image": IMAGE,
        "nodes": 4}  # typed by each parameter's rule, not strings
    capsys.readouterr()
    assert runner.main(["profile", "show"]) == 0
    assert f"{profile_path}:\ncontext: kube\nimage: {IMAGE}\n" in capsys.readouterr().out


@pytest.mark.parametrize("given, name, allowed", [
    (["-p", "nodes", "3"], "nodes", "3 nodes x 8 GPUs = 24 ranks does not divide them"),
    (["-p", "run_id", "mine"], "run_id", "a parameter a profile may set: "),
    (["-p", "namespace", "Not_A_Label"], "namespace", "a Kubernetes namespace"),
    (["-p", "kube_workload", "deployment"], "kube_workload", "one of statefulset, leaderworkerset"),
])
def test_a_profile_a_stage_would_refuse_is_never_written(profile_path, capsys, given, name,
                                                         allowed):
    profile_path.write_text("context: plan\n")  # the profile already there stays as it was
    assert runner.main(["profile", "--context", "kube", *given]) == 2
    said = capsys.readouterr().err
    assert f"parameter '{name}'" in said and allowed in said
    assert profile_path.read_text() == "context: plan\n"


def test_a_file_that_is_not_a_profile_is_refused_naming_it(profile_path):
    profile_path.write_text("- kube\n- slurm\n")
    with pytest.raises(ParameterError) as err:
        profile.load()
    assert str(profile_path) in str(err.value)


def test_the_profile_fills_what_the_notebook_was_not_given_and_an_explicit_value_wins(
        profile_path):
    profile.write({"context": "kube", "namespace": "deepep", "nodes": 4})
    declared = ("context", "namespace", "nodes", "seed")
    filled, supplied = profile.fill(declared, {"context": None, "nodes": 2, "seed": None})
    assert filled == {"context": "kube", "namespace": "deepep", "nodes": 2, "seed": None}
    assert supplied == {"context": "kube", "namespace": "deepep"}
    assert profile.recorded(supplied) == {"path": str(profile_path), "values": supplied}


def papermill(out: Path, *params: str, env=None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "papermill", str(REPO_ROOT / "notebooks" / "04_serve.ipynb"),
            str(out), "--cwd", str(REPO_ROOT / "notebooks"), "--kernel", "python3",
            "--no-progress-bar"]
    for i in range(0, len(params), 2):
        argv += ["-p", params[i], params[i + 1]]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)


def test_the_headline_command_runs_the_profile_s_context(profile_path, tmp_path):
    """`papermill notebooks/04_serve.ipynb out.ipynb -p nodes 2`, as typed: without a profile
    refused naming how to write one; with a profile (context plan), the 2-node serve planned."""
    results = tmp_path / "results"
    refused = papermill(tmp_path / "a.ipynb", "nodes", "2", "results_dir", str(results))
    assert refused.returncode != 0
    assert "1 on the local context" in refused.stderr
    assert "python -m lib.runner profile --context kube" in refused.stderr
    assert not results.exists() or not any(results.iterdir())  # nothing recorded
    profile.write({"context": "plan", "namespace": "deepep", "image": IMAGE,
                   "model_cache_dir": "/opt/dlami/nvme/models"})
    done = papermill(tmp_path / "b.ipynb", "nodes", "2", "results_dir", str(results),
                     "run_id", "headline")
    assert done.returncode == 0, done.stderr[-2000:]
    run = results / "headline"
    record = json.loads((run / "run.json").read_text())
    assert record["context"] == "plan" and record["parameters"]["nodes"] == 2
    assert record["profile"]["path"] == str(profile_path)
    assert record["profile"]["values"]["context"] == "plan"
    assert record["profile"]["values"]["namespace"] == "deepep"
    manifest = (run / "04_serve" / "manifests" / "vllm.yaml").read_text()
    assert "namespace: deepep" in manifest and IMAGE in manifest and "replicas: 2" in manifest


def test_papermill_s_own_parameters_file_wins_over_the_profile(profile_path, tmp_path):
    """`papermill ... -f params.yaml` (papermill's own file of parameters) works beside a
    profile: what the file gives wins, as an explicit -p does; what it leaves out the profile
    fills; run.json records which values the profile supplied."""
    profile.write({"context": "plan", "namespace": "deepep", "image": IMAGE,
                   "model_cache_dir": "/opt/dlami/nvme/models"})
    given = tmp_path / "params.yaml"
    given.write_text(yaml.safe_dump({"nodes": 2, "namespace": "from-file", "run_id": "filed",
                                     "results_dir": str(tmp_path / "results")}))
    argv = [sys.executable, "-m", "papermill", str(REPO_ROOT / "notebooks" / "04_serve.ipynb"),
            str(tmp_path / "out.ipynb"), "--cwd", str(REPO_ROOT / "notebooks"), "--kernel",
            "python3", "--no-progress-bar", "-f", str(given)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    run = tmp_path / "results" / "filed"
    record = json.loads((run / "run.json").read_text())
    assert record["context"] == "plan" and record["parameters"]["nodes"] == 2
    assert record["parameters"]["namespace"] == "from-file"
    supplied = record["profile"]["values"]
    assert supplied["context"] == "plan" and supplied["image"] == IMAGE  # what the file left out
    assert "namespace" not in supplied  # the file's value, not the profile's
    manifest = (run / "04_serve" / "manifests" / "vllm.yaml").read_text()
    assert "namespace: from-file" in manifest and IMAGE in manifest and "replicas: 2" in manifest


def test_a_replay_never_reads_the_profile(profile_path, tmp_path, monkeypatch):
    from lib.core.stage import REPLAY_ENV
    from lib.stages.opening import open_stage

    profile.write({"context": "plan", "namespace": "deepep"})
    reference = REPO_ROOT / "results" / (REPO_ROOT / "results" / "REFERENCE").read_text().strip()
    monkeypatch.setenv(REPLAY_ENV, str(reference))
    stage = open_stage("00_cluster", {"context": None, "run_id": "", "results_dir": "results"})
    assert stage.context == "local" and stage["namespace"] == "deepep-repro"
