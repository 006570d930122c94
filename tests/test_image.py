"""Stage 02: hadolint and shellcheck clean, every Dockerfile ARG equal to its pin, and the gates
failing on a wrong ARG, a `grep -q` after a pipe, `:latest`, a trailing ARG comment, a leaky
.dockerignore; the build gated on a Docker engine (a stand-in `docker` on PATH here)."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from lib.stages import registry as params
from lib.roots import pins
from lib.core.door import REPO_ROOT, Door
from lib.core.stage import Stage
from lib.stages import image

STAGE = "02_image"
DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
HADOLINT = REPO_ROOT / ".venv" / "bin" / "hadolint"
SHELLCHECK = REPO_ROOT / ".venv" / "bin" / "shellcheck"


def repo_scripts() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--",
                             *image.SCRIPT_PATHSPECS], cwd=REPO_ROOT, check=True, text=True,
                            capture_output=True).stdout.split()
    # as stage 02 (image.shell_scripts): a run's evidence under results/ (a device run's script,
    # a plan's rendered ones) is kept as it ran, not the repository's code
    return sorted(set(p for p in listed if not p.startswith("results/")))


# ---- what `make test` promises: the linters are clean --------------------------------------------
def test_hadolint_is_clean_on_the_dockerfile():
    result = subprocess.run([str(HADOLINT), "--no-color", str(DOCKERFILE)], text=True,
                            capture_output=True, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_shellcheck_is_clean_on_every_shell_script():
    scripts = repo_scripts()
    assert "docker/verify-image.sh" in scripts
    result = subprocess.run([str(SHELLCHECK), "-f", "gcc", *scripts], text=True,
                            capture_output=True, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_dockerfile_arg_equals_its_pin():
    data = pins.load()
    expected = pins.dockerfile_args(data)
    result = image.compare_args(DOCKERFILE.read_text(), expected, pins.arg_owner(data))
    assert result["mismatched"] == [] and result["unpinned"] == [] and result["missing"] == []
    assert result["trailing_comments"] == []
    assert result["checked"] == len(expected) >= 20
    declared = {a["name"]: a["value"] for a in image.parse_args(DOCKERFILE.read_text())
                if a["value"] is not None}
    assert declared["DEEPEP_SHA"] == data["pins"]["deepep"]["commit"]
    assert declared["BASE_IMAGE"] == pins.image_ref(data["pins"]["base_image"])
    assert declared["NCCL_PIP_VERSION"] == data["pins"]["nccl"]["version"]


def test_the_committed_dockerfile_passes_the_static_checks():
    text = DOCKERFILE.read_text()
    assert image.pipe_grep_quiet(text, dockerfile=True) == []
    assert image.layer_problems(text) == []
    refs = image.image_references(text)
    assert [image.mutable_reason(r["ref"]) for r in refs] == [None]
    ignore = (REPO_ROOT / "docker" / ".dockerignore").read_text()
    assert image.dockerignore_problems(ignore, image.copy_sources(text)) == []
    for script in repo_scripts():
        assert image.pipe_grep_quiet((REPO_ROOT / script).read_text()) == [], script


# ---- the pure checks -------------------------------------------------------------------------------
@pytest.mark.parametrize("line, found", [
    ("RUN nm -D x.so | grep -q ncclGinPlugin_v14", True),
    ("RUN nm -D x.so | grep -Eq 'a|b'", True),
    ("RUN nm -D x.so | grep --quiet x", True),
    ("RUN grep -q x /tmp/file", False),  # no pipe: no SIGPIPE
    ("RUN n=\"$(nm -D x | grep -c x || true)\"", False),
    ("RUN a || grep -q x f", False),
])
def test_pipe_grep_quiet(line, found):
    assert bool(image.pipe_grep_quiet(f"FROM a:1@sha256:{'0' * 64}\n{line}\n",
                                      dockerfile=True)) is found


def test_mutable_references():
    digest = "@sha256:" + "a" * 64
    assert image.mutable_reason("nvidia/cuda:13.0.0-devel-ubuntu22.04" + digest) is None
    assert "latest" in image.mutable_reason("ubuntu:latest")
    assert "no tag" in image.mutable_reason("ubuntu")
    assert "without a digest" in image.mutable_reason("ubuntu:22.04")
    refs = image.image_references("ARG B=ubuntu:latest\nFROM ${B} AS build\nFROM build\n"
                                  "COPY --from=build /a /a\nCOPY --from=alpine:3 /b /b\n")
    assert [r["ref"] for r in refs] == ["ubuntu:latest", "alpine:3"]


def test_dockerignore_semantics():
    rules = image.parse_dockerignore("*\n!verify-image.sh\n**/.env\n**/*token*\n")
    assert image.is_excluded("anything.txt", rules)
    assert not image.is_excluded("verify-image.sh", rules)
    assert image.is_excluded("deep/dir/.env", rules) and image.is_excluded(".env", rules)
    assert image.is_excluded("a/hf_token.txt", rules)
    leaky = image.dockerignore_problems(".git\n", ["verify-image.sh"])
    assert any(p.startswith(".env (secret)") for p in leaky)
    assert any(p.startswith("results/") for p in leaky)
    hidden = image.dockerignore_problems((REPO_ROOT / "docker" / ".dockerignore").read_text(),
                                         ["verify-image.sh", "secrets.env"])
    assert hidden == ["secrets.env is COPYed but excluded"]


# ---- the stage on a copy of the repository -----------------------------------------------------
@pytest.fixture
def repo_copy(tmp_path):
    """docker/, pins.yaml and every shell script of the repository, in a fresh git repo."""
    root = tmp_path / "repo"
    (root / "docker").mkdir(parents=True)
    for name in ("Dockerfile", ".dockerignore", "verify-image.sh"):
        shutil.copy2(REPO_ROOT / "docker" / name, root / "docker" / name)
    shutil.copy2(REPO_ROOT / "pins.yaml", root / "pins.yaml")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


def make_stage(run_dir: Path) -> Stage:
    return Stage(STAGE, params.resolve(STAGE, {}), run_dir, Door(run_dir, STAGE), None)


def gates_of(stage) -> dict:
    return {g.gate.split(" (")[0]: g for g in stage.gates}


def test_stage_passes_every_static_gate_on_the_repository(tmp_path):
    stage = make_stage(tmp_path / "run")
    checks = image.run(stage, build=False)
    gates = gates_of(stage)
    assert {n: g.status for n, g in gates.items()} == {n: "PASS" for n in gates}, \
        [(g.gate, g.reason) for g in stage.gates if g.status != "PASS"]
    assert len(gates) == 8
    assert "docker/verify-image.sh" in checks["shell_scripts"]
    for name in ("hadolint.txt", "shellcheck.txt", "checks.json"):
        assert (tmp_path / "run" / STAGE / name).exists()
    stage.finish()
    # replay: the same gates and files from the transcript alone (finish raises otherwise)
    run_dir = tmp_path / "run"
    replay = Stage(STAGE, params.resolve(STAGE, {}), run_dir, Door(run_dir, STAGE, replay=True),
                   run_dir)
    assert image.run(replay, build=False) == checks
    replay.finish()


def test_a_wrong_arg_fails_the_gate(tmp_path, repo_copy):
    dockerfile = repo_copy / "docker" / "Dockerfile"
    text = dockerfile.read_text()
    assert "ARG NCCL_PIP_VERSION=2.30.4\n" in text
    dockerfile.write_text(text.replace("ARG NCCL_PIP_VERSION=2.30.4\n",
                                       "ARG NCCL_PIP_VERSION=2.28.9\n"))
    stage = make_stage(tmp_path / "run")
    checks = image.run(stage, repo=repo_copy, build=False)
    failed = gates_of(stage)["every Dockerfile ARG equals its pin"]
    assert failed.status == "FAIL"
    assert "ARG NCCL_PIP_VERSION" in failed.reason and "'2.30.4'" in failed.reason
    assert "pin nccl says" in failed.reason
    assert [m["arg"] for m in checks["args"]["mismatched"]] == ["NCCL_PIP_VERSION"]


def test_an_unpinned_or_undeclared_arg_fails(tmp_path, repo_copy):
    dockerfile = repo_copy / "docker" / "Dockerfile"
    text = dockerfile.read_text()
    text = text.replace("ARG AIPERF_VERSION=0.10.0\n", "ARG EXTRA=1\n")
    dockerfile.write_text(text)
    stage = make_stage(tmp_path / "run")
    checks = image.run(stage, repo=repo_copy, build=False)
    assert gates_of(stage)["every Dockerfile ARG equals its pin"].status == "FAIL"
    assert checks["args"]["missing"] == ["AIPERF_VERSION"]
    assert [u["arg"] for u in checks["args"]["unpinned"]] == ["EXTRA"]


def test_grep_q_after_a_pipe_latest_and_trailing_comments_fail(tmp_path, repo_copy):
    dockerfile = repo_copy / "docker" / "Dockerfile"
    text = dockerfile.read_text()
    pinned = pins.image_ref(pins.load()["pins"]["base_image"])
    text = text.replace(f"ARG BASE_IMAGE={pinned}\n",
                        f"ARG BASE_IMAGE={pinned}\nARG PROBE=1 # a trailing comment\n")
    text = text.replace("FROM ${BASE_IMAGE}\n", "FROM nvidia/cuda:latest\n")
    text += "RUN nm -D /opt/x.so | grep -q ncclGinPlugin_v14\n"
    dockerfile.write_text(text)
    script = repo_copy / "docker" / "check.sh"
    script.write_text("#!/usr/bin/env bash\nset -euo pipefail\nldconfig -p | grep -q libnccl\n")
    stage = make_stage(tmp_path / "run")
    checks = image.run(stage, repo=repo_copy, build=False)
    gates = gates_of(stage)
    quiet = gates["no `grep -q` after a pipe"]
    assert quiet.status == "FAIL"
    assert {q["file"] for q in checks["pipe_grep_quiet"]} == {"docker/Dockerfile",
                                                            "docker/check.sh"}
    latest = gates["image references are immutable"]
    assert latest.status == "FAIL" and ":latest moves" in latest.reason
    trailing = gates["no trailing comment on an ARG line"]
    assert trailing.status == "FAIL" and "ARG PROBE" in trailing.reason


def test_a_dropped_repin_and_a_leaky_dockerignore_fail(tmp_path, repo_copy):
    dockerfile = repo_copy / "docker" / "Dockerfile"
    text = dockerfile.read_text()
    text = text.replace("--force-reinstall --no-deps", "--no-deps")
    dockerfile.write_text(text + 'RUN python3 -m pip install --no-cache-dir "rich==14.1.0"\n')
    (repo_copy / "docker" / ".dockerignore").write_text(".git\n")
    stage = make_stage(tmp_path / "run")
    image.run(stage, repo=repo_copy, build=False)
    gates = gates_of(stage)
    layers = gates["the fail-loud layers are in the Dockerfile"]
    assert layers.status == "FAIL" and "the last pip layer re-pins nvidia-nccl-cu13" in layers.reason
    leaky = gates[".dockerignore keeps secrets and run data out of the build context"]
    assert leaky.status == "FAIL" and "setup/env_vars (secret)" in leaky.reason


def test_shellcheck_findings_fail_the_gate(tmp_path, repo_copy):
    (repo_copy / "docker" / "bad.sh").write_text("#!/bin/sh\necho $1\n")
    stage = make_stage(tmp_path / "run")
    image.run(stage, repo=repo_copy, build=False)
    gate = gates_of(stage)["shellcheck clean on every shell script"]
    assert gate.status == "FAIL" and "SC2086" in gate.reason
    assert "bad.sh" in (tmp_path / "run" / STAGE / "shellcheck.txt").read_text()


# ---- the build, with a stand-in docker on PATH --------------------------------------------------
def fake_docker(bin_dir: Path, script: str) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / "docker"
    path.write_text("#!/usr/bin/env bash\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def test_no_engine_is_a_skip_with_its_reason(tmp_path, repo_copy, monkeypatch):
    fake_docker(tmp_path / "bin", 'echo "Client: Docker Engine"\n'
                'echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock." >&2\n'
                "exit 1\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    stage = make_stage(tmp_path / "run")
    image.run(stage, repo=repo_copy)
    gates = gates_of(stage)
    for name in ("docker build", "verify-image.sh in the built image"):
        assert gates[name].status == "SKIP"
        assert gates[name].reason == ("no Docker engine: docker info exited 1: Cannot connect "
                                      "to the Docker daemon at unix:///var/run/docker.sock.")


def test_the_build_log_is_kept_whole_and_gated(tmp_path, repo_copy, monkeypatch):
    fake_docker(tmp_path / "bin", textwrap_script())
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    stage = make_stage(tmp_path / "run")
    checks = image.run(stage, repo=repo_copy)
    gates = gates_of(stage)
    assert gates["docker build"].status == "PASS"
    assert gates["verify-image.sh in the built image"].status == "PASS"
    log = (tmp_path / "run" / STAGE / "build.log").read_text()
    assert log.count("\n") >= 5000 and "step 1" in log and "step 5000" in log  # whole, no tail
    assert checks["build"]["tag"].startswith("deepep-v2-efa:pins-")
    assert "-f" in read_build_argv(tmp_path) and str(repo_copy / "docker") in read_build_argv(tmp_path)
    assert "--build-context=guide-patches=patches" in read_build_argv(tmp_path)

    monkeypatch.setenv("FAKE_BUILD_RC", "2")
    stage = make_stage(tmp_path / "run2")
    image.run(stage, repo=repo_copy)
    gates = gates_of(stage)
    assert gates["docker build"].status == "FAIL" and "nvcc error" in gates["docker build"].reason
    assert gates["verify-image.sh in the built image"].status == "SKIP"


def test_the_build_passes_the_patches_context_layer_7b_copies_its_pinned_patch_from():
    """Layer 7b COPYs this guide's vLLM patch 0002 from the named context guide-patches: the
    build passes that context, the file is there, its sha256 is the pin's and the ARG's, and the
    named context is no image reference (an unknown --from still is)."""
    from lib.engines import site_patches
    from lib.places.local import BUILD_CONTEXTS

    text = DOCKERFILE.read_text()
    data = pins.load()
    pin = data["pins"]["vllm_patch_deepep_v2_timeouts"]
    copied = [rest.split() for _, word, rest in image.instructions(text)
              if word == "COPY" and "--from=guide-patches" in rest]
    assert len(copied) == 1, "Layer 7b copies exactly one file from guide-patches"
    source = REPO_ROOT / BUILD_CONTEXTS["guide-patches"] / copied[0][1]
    assert source == REPO_ROOT / pin["path"]
    assert site_patches.sha256_file(source) == pin["sha256"]
    declared = {a["name"]: a["value"] for a in image.parse_args(text) if a["value"] is not None}
    assert declared["VLLM_PATCH_0002_SHA256"] == pin["sha256"]
    assert "guide-0002" in text and "patch -p1" in text  # applied and checked, fail-loud
    refs = image.image_references(text + "COPY --from=guide-patchez /a /a\n")
    assert [r["ref"] for r in refs][-1] == "guide-patchez" and "guide-patches" not in [
        r["ref"] for r in refs]


def textwrap_script() -> str:
    return (
        'case "$1" in\n'
        '  info) echo "Server: fake"; exit 0;;\n'
        '  build) echo "$@" > "$(dirname "$0")/build-argv";\n'
        '         for i in $(seq 1 5000); do echo "step $i" >&2; done;\n'
        '         if [ "${FAKE_BUILD_RC:-0}" != 0 ]; then echo "nvcc error: boom" >&2; exit "$FAKE_BUILD_RC"; fi;\n'
        '         exit 0;;\n'
        '  run) echo "PASS plugin present: x"; echo "verify-image: 1/1 checks PASS"; exit 0;;\n'
        'esac\nexit 3\n')


def read_build_argv(tmp_path: Path) -> str:
    return (tmp_path / "bin" / "build-argv").read_text()


# ---- verify-image.sh outside the image -----------------------------------------------------------
def test_verify_image_names_what_failed_one_line_per_check(tmp_path):
    script = REPO_ROOT / "docker" / "verify-image.sh"
    bare = subprocess.run(["bash", str(script)], text=True, capture_output=True,
                          env={"PATH": "/usr/bin:/bin"})
    assert bare.returncode == 1
    assert "FAIL environment PIN_NCCL_VERSION" in bare.stdout
    env = {"PATH": "/usr/bin:/bin", "PIN_TORCH_VERSION": "2.11.0+cu130",
           "PIN_VLLM_VERSION": "0.24.0", "PIN_AIPERF_VERSION": "0.10.0",
           "PIN_NCCL_VERSION": "2.30.4", "PIN_NVSHMEM_VERSION": "3.6.5",
           "PIN_DEEPEP_SHA": "b" * 40, "PIN_DEEPEP_PATCHED_TREE": "e" * 40,
           "OFI_NCCL_PLUGIN": str(tmp_path / "none.so"), "DEEPEP_HOME": str(tmp_path),
           "AIPERF_HOME": str(tmp_path)}
    result = subprocess.run(["bash", str(script)], text=True, capture_output=True, env=env)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert all(l.startswith(("PASS ", "FAIL ", "verify-image: ")) for l in lines), lines
    assert "FAIL plugin exports ncclGinPlugin_v14: 0 symbol line(s)" in lines
    assert lines[-1].startswith("verify-image: ") and "FAILED: " in lines[-1]
    assert "plugin present" in lines[-1]
