"""A cluster's refusal is a FAIL, a place's missing capability a SKIP (lib.stages.refusal).

With the real clients: `kubectl` against an API server that does not answer (a kubeconfig
aimed at a closed port on 127.0.0.1) or a context the kubeconfig lacks, and Slurm's `sinfo`
with a configuration it cannot read (or absent: exit 127). Each ends in one FAIL gate naming
the context and the command, the stage's `finish` raising once gates.json is written, the
notebook exiting non-zero under papermill, and the runner (`make run`) stopping at 00 with
exit 1. The refusals only a live control plane or Slurm can give (an apply refused, an
allocation refused, a partition without nodes) are in test_kube_stages and test_slurm_place.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lib.core import evidence
from lib.core.door import REPO_ROOT, Door, read_transcript
from lib.core.errors import PlaceError, StageRefused
from lib.core.stage import REFUSED_GATE, Stage
from lib.stages import cluster as stage00
from lib.stages import kernel as stage03
from lib.stages import registry
from lib.stages import serve as stage04
from lib.stages.refusal import REFUSED_KEY, refusals_fail, shows_refusal

PLANTED = "planted-kube-token-5f2a9c"  # in the kubeconfig: must reach no evidence


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket is: nothing listens there


@pytest.fixture
def dead_kubeconfig(tmp_path, monkeypatch) -> Path:
    """A kubeconfig whose one context, 'dead', names an API server nothing listens on."""
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- cluster: {{server: 'https://127.0.0.1:{closed_port()}'}}\n  name: dead\n"
        "contexts:\n- context: {cluster: dead, user: u}\n  name: dead\n"
        f"current-context: dead\nusers:\n- name: u\n  user: {{token: {PLANTED}}}\n")
    monkeypatch.setenv("KUBECONFIG", str(path))
    return path


@pytest.fixture
def no_slurm(tmp_path, monkeypatch) -> None:
    """Slurm's clients given a configuration file that does not exist: sinfo exits non-zero
    (or 127 where Slurm is not installed at all)."""
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "absent" / "slurm.conf"))
    # sinfo retries a missing configuration for 60 s (measured: 59.0 s), so the place's query
    # timeout ends it: 3 s here instead of 30 gives the same refusal 27 s sooner per test
    monkeypatch.setattr("lib.places.slurm.waits.QUERY_TIMEOUT_S", 3.0)


def stage_of(run_dir: Path, name: str, given: dict) -> Stage:
    resolved = registry.resolve(name, given)  # context plan: its door plans, as the opener's
    return Stage(name, resolved, run_dir, Door(run_dir, name, plan=given.get("context") == "plan"),
                 None)


def refusal_of(stage: Stage):
    fails = [g for g in stage.gates if g.status == "FAIL"]
    assert [g.gate for g in fails] == [REFUSED_GATE], [g.as_dict() for g in stage.gates]
    return fails[0]


def assert_finish_raises_and_gates_are_written(stage: Stage) -> list[dict]:
    with pytest.raises(StageRefused, match=f"{stage.name} stopped: "):
        stage.finish()
    gates = evidence.read_gates(stage.dir)
    assert [g["gate"] for g in gates if g["status"] == "FAIL"] == [REFUSED_GATE]
    return gates


# ---- kube ------------------------------------------------------------------------------------
def test_04_on_a_kube_context_whose_api_server_does_not_answer_fails_naming_it(
        tmp_path, dead_kubeconfig):
    stage = stage_of(tmp_path / "run", "04_serve",
                     {"context": "kube", "kube_context": "dead", "nodes": 2, "engine": "vllm"})
    data = stage04.run(stage)
    assert REFUSED_KEY in data
    fail = refusal_of(stage)
    assert fail.observed["where"] == "kube context 'dead' (namespace deepep-repro)"
    assert fail.observed["command"] == "kubectl --context dead get nodes -o json"
    assert fail.observed["exit_code"] == 1
    assert "kube context 'dead'" in fail.reason and "`kubectl --context dead get nodes" in fail.reason
    assert "was refused" in fail.reason  # kubectl's own last line, quoted
    assert not [g for g in stage.gates if g.status == "SKIP"]  # not "not measured" as a SKIP
    assert fail.evidence and all((stage.run_dir / e).exists() for e in fail.evidence)
    assert_finish_raises_and_gates_are_written(stage)
    recorded = (stage.run_dir / "transcript.jsonl").read_text() + json.dumps(
        evidence.read_gates(stage.dir))
    assert PLANTED not in recorded


def test_a_kube_context_the_kubeconfig_lacks_fails_naming_it(tmp_path, dead_kubeconfig):
    stage = stage_of(tmp_path / "run", "00_cluster",
                     {"context": "kube", "kube_context": "not-there", "nodes": 2})
    stage00.run(stage)
    fail = refusal_of(stage)
    assert fail.observed["where"].startswith("kube context 'not-there'")
    assert "kubectl --context not-there get nodes" in fail.observed["command"]
    assert "not-there" in fail.reason.split("exited 1: ", 1)[1]  # kubectl names the context
    assert_finish_raises_and_gates_are_written(stage)


def test_a_plan_is_a_skip_not_a_refusal(tmp_path):
    stage = stage_of(tmp_path / "run", "04_serve",
                     {"context": "plan", "nodes": 2, "engine": "vllm"})
    data = stage04.run(stage)
    assert REFUSED_KEY not in data and data["skipped"]
    assert not [g for g in stage.gates if g.gate == REFUSED_GATE]
    stage.finish()  # no raise: a plan refuses nothing


# ---- slurm -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, given", [
    ("00_cluster", {}),
    ("03_kernel_test", {"venv": ".venv"}),
    ("04_serve", {"engine": "transformers"}),  # no venv given: the cluster is asked first
])
def test_a_slurm_whose_sinfo_fails_is_a_fail_naming_the_partition_and_sinfo(
        tmp_path, no_slurm, name, given):
    stage = stage_of(tmp_path / "run", name,
                     {"context": "slurm", "nodes": 2, "partition": "gpu", **given})
    run = {"00_cluster": stage00.run, "03_kernel_test": stage03.run,
           "04_serve": stage04.run}[name]
    assert REFUSED_KEY in run(stage)
    fail = refusal_of(stage)
    assert fail.observed["where"] == "slurm partition 'gpu'"
    assert fail.observed["command"].startswith("sinfo ")
    assert fail.observed["exit_code"] != 0
    assert_finish_raises_and_gates_are_written(stage)


# ---- the handler itself ----------------------------------------------------------------------
def test_the_handler_catches_only_refusals_and_the_display_says_so(tmp_path, capsys):
    stage = stage_of(tmp_path / "run", "00_cluster", {})

    @refusals_fail
    def refused(stage):
        raise PlaceError("kube context 'x'", "the API server did not answer")

    @refusals_fail
    def broken(stage):
        raise KeyError("a bug is not a refusal")

    @shows_refusal
    def show(stage, data):
        return "a table"

    data = refused(stage)
    assert data == {REFUSED_KEY: "kube context 'x': the API server did not answer"}
    assert show(stage, data) is None
    assert "not measured: the cluster refused: kube context 'x'" in capsys.readouterr().out
    assert show(stage, {"facts": 1}) == "a table"
    with pytest.raises(KeyError):
        broken(stage)
    fail = refusal_of(stage)
    assert fail.observed == {"where": "kube context 'x'", "command": None, "exit_code": None}
    assert fail.evidence == []


# ---- papermill and the runner: what a user types ---------------------------------------------
def _papermill(notebook: str, out: Path, results: Path, *params: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "papermill", f"notebooks/{notebook}.ipynb", str(out),
            "-p", "results_dir", str(results), *params]
    return subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def test_papermill_04_on_an_unreachable_kube_exits_non_zero_with_the_fail(
        tmp_path, dead_kubeconfig):
    done = _papermill("04_serve", tmp_path / "out.ipynb", tmp_path / "results",
                      "-p", "context", "kube", "-p", "nodes", "2")
    assert done.returncode != 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "StageRefused: 04_serve stopped: kubectl's current context" in done.stderr
    (run_dir,) = (tmp_path / "results").iterdir()
    gates = evidence.read_gates(run_dir / "04_serve")
    fail = [g for g in gates if g["status"] == "FAIL"]
    assert [g["gate"] for g in fail] == [REFUSED_GATE]
    assert fail[0]["observed"]["command"] == "kubectl get nodes -o json"
    out = (tmp_path / "out.ipynb").read_text()
    assert "not measured: the cluster refused" in out and PLANTED not in out


@pytest.fixture
def unreadable_slurm_conf(tmp_path, monkeypatch) -> None:
    """Slurm's clients given a configuration file they cannot parse: sinfo exits 1 at once
    ("Parse error ... Unable to process configuration file"; 127 where Slurm is not installed).
    For papermill's kernel, which no monkeypatch of the place's query timeout reaches: an
    absent file kept it waiting out sinfo's retries to the 30 s timeout (measured: 34 s)."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("this is not a slurm.conf\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))


def test_papermill_04_without_a_slurm_exits_non_zero_with_the_fail(tmp_path,
                                                                   unreadable_slurm_conf):
    done = _papermill("04_serve", tmp_path / "out.ipynb", tmp_path / "results",
                      "-p", "context", "slurm", "-p", "nodes", "2")
    assert done.returncode != 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "StageRefused: 04_serve stopped: slurm's default partition" in done.stderr
    (run_dir,) = (tmp_path / "results").iterdir()
    fail = [g for g in evidence.read_gates(run_dir / "04_serve") if g["status"] == "FAIL"]
    assert fail[0]["observed"]["command"].startswith("sinfo ")


def test_the_runner_stops_at_00_when_the_cluster_refuses(tmp_path, dead_kubeconfig):
    results = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, "-m", "lib.runner", "run", "--context", "kube", "--no-book",
         "-p", "results_dir", str(results)], cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=600, env={**os.environ, "KUBECONFIG": str(dead_kubeconfig)})
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert "[00_cluster] the cluster refused: the run stops here" in done.stdout
    assert f"FAIL {REFUSED_GATE}: kubectl's current context" in done.stdout
    assert "[01_public_roots]" not in done.stdout  # nothing after 00 was started
    (run_dir,) = results.iterdir()
    assert sorted(p.name for p in run_dir.iterdir() if p.name[:2].isdigit()) == ["00_cluster"]
    assert evidence.verify(run_dir) == []  # sealed, every file as listed
    ran = [e["key"] for e in read_transcript(run_dir / "transcript.jsonl")
           if e["kind"] == "run" and e["stage"] == "00_cluster"]
    assert ["kubectl", "get", "nodes", "-o", "json"] in ran
