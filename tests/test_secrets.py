"""Planted secrets reach no evidence: a Hugging Face token, an AWS access key id, secret access
key and session token, a bearer token and the password of a URL, each in the environment of a
real call through the real door, in its arguments, in a server's output and in the guide's own
environment; the run is sealed and no planted value's bytes are in any file under it. And the
kube manifests a plan renders carry the Secret's name only, never the token.
(The style of tests/test_guide.py's test_a_planted_secret_reaches_no_evidence_notebook_or_book.)
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lib.core import evidence
from lib.core import identities as naming
from lib.core.door import Door, read_transcript
from lib.places.kube import manifests as mf

# Built here, so that no secret-shaped string sits in the repository.
HF = "hf_" + "PlantedHuggingFace" + "0123456789abcdef"  # hf_ and 34
AKIA = "AKIA" + "PLANTED012345678"  # AKIA and 16
SECRET_KEY = "Pl4nted/SecretAccessKey+" + "wJalrXUtnFEMIK7M"  # 40 of base64, no shape of its own
SESSION = "IQoJb3JpZ2luX2VjE" + "PlantedSessionToken" * 12 + "=="  # what STS hands out
BEARER = "plantedBearer" + "Tok3n" * 4
PASSWORD = "plantedPassw0rd"
URL = f"https://guide-user:{PASSWORD}@mirror.example/simple/"
# What only a server prints (no call named them): the shapes alone must find them.
SERVER_SECRET_KEY = "Pl4ntedServerOnlyKey/" + "q" * 19
SERVER_BEARER = "plantedServerBearer" + "X9" * 6
PLANTED = {"hf": HF, "akia": AKIA, "secret_key": SECRET_KEY, "session": SESSION,
           "bearer": BEARER, "password": PASSWORD, "server_secret_key": SERVER_SECRET_KEY,
           "server_bearer": SERVER_BEARER}
ENV_NAMES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
             "AWS_SESSION_TOKEN", "GUIDE_AUTHORIZATION", "PIP_INDEX_URL")
CALL_ENV = {"HF_TOKEN": HF, "AWS_ACCESS_KEY_ID": AKIA, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_SESSION_TOKEN": SESSION, "GUIDE_AUTHORIZATION": f"Bearer {BEARER}",
            "PIP_INDEX_URL": URL}
PRINT_ENV_BARE = ('printf "%s\\n" "$HF_TOKEN" "$AWS_ACCESS_KEY_ID" "$AWS_SECRET_ACCESS_KEY" '
                  '"$AWS_SESSION_TOKEN" "$GUIDE_AUTHORIZATION" "$PIP_INDEX_URL"')


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, tmp_path):
    """None of the planted values in this process's environment unless a test plants them:
    each net is tested on its own."""
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(naming.STATE_DIR_ENV, str(tmp_path / "state"))


def leaks(root: Path, values: dict[str, str] = PLANTED) -> list[str]:
    """`path: which` for every file under root holding a planted value's bytes, whole or either
    half of it (a mask that cut a value short, `...SessionToken=[REDACTED]`, leaks the rest)."""
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        for name, value in values.items():
            half = len(value) // 2
            if any(piece.encode() in data for piece in (value, value[:half], value[half:])):
                found.append(f"{path.relative_to(root)}: {name}")
    return found


def test_the_leak_check_finds_a_value_written_past_the_door(tmp_path):
    """The check below can fail: a value written into the run without the door is found."""
    run = tmp_path / "run"
    Door(run, "s").run(["echo", "clean"], timeout=10)
    (run / "s").mkdir()
    (run / "s" / "stray.txt").write_text(f"oops {SECRET_KEY}\n")
    evidence.seal(run)
    assert leaks(run) == ["s/stray.txt: secret_key"]


def test_secrets_in_the_environment_of_a_call_reach_no_evidence(tmp_path):
    run = tmp_path / "run"
    door = Door(run, "00_cluster")
    listed = door.run(["env"], timeout=10, env=CALL_ENV)
    bare = door.run(["sh", "-c", PRINT_ENV_BARE], timeout=10, env=CALL_ENV)
    later = door.run(["sh", "-c", f'echo "later: {SECRET_KEY}"'], timeout=10)
    evidence.seal(run)
    assert leaks(run) == []
    # what was printed was recorded, masked where the secrets were
    assert "HF_TOKEN=[REDACTED]" in listed.stdout
    assert "AWS_SESSION_TOKEN=[REDACTED]" in listed.stdout
    assert "PIP_INDEX_URL=https://guide-user:[REDACTED]@mirror.example/simple/" in listed.stdout
    assert bare.stdout.splitlines() == ["[REDACTED]"] * 5 + [
        "https://guide-user:[REDACTED]@mirror.example/simple/"]
    assert later.stdout == "later: [REDACTED]\n"  # the stage's later calls keep it masked
    [env, *_] = [e["env"] for e in read_transcript(run / "transcript.jsonl")]
    assert env == {**{k: "[REDACTED]" for k in CALL_ENV if k != "PIP_INDEX_URL"},
                   "PIP_INDEX_URL": "https://guide-user:[REDACTED]@mirror.example/simple/"}


def test_secrets_in_the_arguments_of_a_call_reach_no_evidence(tmp_path):
    run = tmp_path / "run"
    door = Door(run, "02_image")
    # printed back as given, then the secret key alone, away from the flag that named it
    argv = ["sh", "-c", 'printf "%s\\n" "$@"; echo "alone: $5"', "sh", "--hf-token", HF, AKIA,
            "--aws-secret-access-key", SECRET_KEY, f"--aws-session-token={SESSION}",
            "-H", f"Authorization: Bearer {BEARER}", URL, "--num-tokens", "128"]
    result = door.run(argv, timeout=10)
    plan = Door(run, "03_kernel_test", plan=True)
    plan.plan(["aws", "configure", "set", "--aws-secret-access-key", SECRET_KEY], note=URL)
    evidence.seal(run)
    assert leaks(run) == []
    assert result.argv[4:] == [
        "--hf-token", "[REDACTED]", "[REDACTED]", "--aws-secret-access-key", "[REDACTED]",
        "--aws-session-token=[REDACTED]", "-H", "Authorization: Bearer [REDACTED]",
        "https://guide-user:[REDACTED]@mirror.example/simple/", "--num-tokens", "128"]
    assert result.stdout.splitlines() == result.argv[4:] + ["alone: [REDACTED]"]


def test_secrets_in_a_servers_output_reach_no_evidence(tmp_path):
    """A server prints credentials the door never saw (read from a file outside the run, as
    `aws sts` or a pull would print them) and, started with them in its env, prints those bare.
    Its log is the run's file; read while it runs and cleaned at its stop."""
    run = tmp_path / "run"
    outside = tmp_path / "server-prints.txt"
    outside.write_text(
        f"token {HF}\n"
        f'{{"Credentials": {{"AccessKeyId": "{AKIA}", "SecretAccessKey": "{SERVER_SECRET_KEY}", '
        f'"SessionToken": "{SESSION}"}}}}\n'
        f"aws_secret_access_key = {SERVER_SECRET_KEY}\n"
        f"assumed the role; session {SESSION}\n"
        f"-H 'Authorization: Bearer {SERVER_BEARER}'\n"
        f"pulling from https://guide-user:{PASSWORD}@mirror.example/simple/\n")
    door = Door(run, "04_serve")
    log = run / "04_serve" / "server.log"
    env = {"AWS_SECRET_ACCESS_KEY": SECRET_KEY, "GUIDE_AUTHORIZATION": f"Bearer {BEARER}"}
    server = door.start(["sh", "-c", 'cat "$1"; echo "bare $AWS_SECRET_ACCESS_KEY"; '
                                     'echo "bare ${GUIDE_AUTHORIZATION#Bearer }"; echo ready; '
                                     'exec sleep 30', "sh", str(outside)],
                        log_path=log, env=env)
    try:
        for _ in range(200):
            text = door.read_text(log) or ""
            if "ready" in text:
                break
            door.sleep(0.05)
    finally:
        door.stop(server)
    assert "ready" in text and "bare [REDACTED]" in text
    logged = log.read_text()
    assert "bare [REDACTED]\nbare [REDACTED]\nready" in logged
    assert '"SecretAccessKey": "[REDACTED]"' in logged and '"SessionToken": "[REDACTED]"' in logged
    assert "https://guide-user:[REDACTED]@mirror.example/simple/" in logged
    evidence.seal(run)
    assert leaks(run) == []


def test_secrets_in_the_guides_own_environment_reach_no_evidence(tmp_path, monkeypatch):
    for name, value in CALL_ENV.items():
        monkeypatch.setenv(name, value)
    run = tmp_path / "run"
    door = Door(run, "00_cluster")
    door.run(["env"], timeout=10)
    bare = door.run(["sh", "-c", PRINT_ENV_BARE], timeout=10)
    door.run(["echo", SECRET_KEY, "--token", HF], timeout=10)
    evidence.seal(run)
    assert leaks(run) == []
    assert bare.stdout.splitlines()[:5] == ["[REDACTED]"] * 5


# ---- the cluster's manifests ------------------------------------------------------------------
SERVE = dict(run_id="run-20261201-a",
             image="registry.example/guide/deepep-v2-efa@sha256:" + "5e" * 32,
             model_cache_dir="/mnt/nvme/hf-cache", hf_token_secret="hf-token")


def token_envs(objects: list[dict]) -> list[dict]:
    """Every container env entry that names a Hugging Face token variable."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            for entry in node.get("env") or []:
                if isinstance(entry, dict) and entry.get("name") in mf.TOKEN_VARS:
                    found.append(entry)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(objects)
    return found


@pytest.mark.parametrize("render", [mf.vllm_objects, mf.leaderworkerset_objects])
def test_rendered_manifests_carry_the_secrets_name_never_the_token(render, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", HF)
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", HF)
    objects = render(**SERVE)
    assert HF not in mf.to_yaml(objects) and HF not in json.dumps(objects)
    envs = token_envs(objects)
    assert envs and all(e == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "hf-token", "key": "token", "optional": False}}} for e in envs), envs


def test_a_kube_plan_with_a_token_secret_records_no_token_anywhere(tmp_path, monkeypatch):
    """`-p context plan -p hf_token_secret hf-token` with HF_TOKEN set: the real 04 notebook
    through the runner renders the serve into the run (manifests, transcript, notebook), and
    the token is in none of its files; the applied manifest refers to the Secret by name."""
    from lib import runner

    monkeypatch.setenv("HF_TOKEN", HF)
    monkeypatch.setattr(runner, "RESULTS", tmp_path)
    run_dir, rc = runner.run_guide("plan", "plan-secret", {
        "results_dir": str(tmp_path), "hf_token_secret": "hf-token"}, ["04_serve"])
    assert rc == 0, (run_dir / "notebooks" / "04_serve.papermill.log").read_text()[-3000:]
    rendered = list(yaml.safe_load_all((run_dir / "04_serve" / "manifests" / "vllm.yaml")
                                       .read_text()))
    envs = token_envs(rendered)
    assert envs and all(e["valueFrom"]["secretKeyRef"]["name"] == "hf-token" and "value" not in e
                        for e in envs), envs
    evidence.seal(run_dir)
    assert leaks(run_dir, {"hf": HF}) == []
    assert (run_dir / "notebooks" / "04_serve.ipynb").exists()
