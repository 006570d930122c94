"""Parameters, evidence and redaction: the pure parts of the foundation."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lib.core import evidence
from lib.stages import registry as params
from lib.core import redact
from lib.core.errors import ReplayMismatch
from lib.core.evidence import EvidenceError, Gate


# ---- parameters ------------------------------------------------------------------------------
def test_context_defaults_and_explicit_values_win():
    local = params.resolve("05_sweep", {"context": "local"})
    kube = params.resolve("05_sweep", {"context": "kube"})
    assert local["concurrency"] == [1, 2, 4] and kube["concurrency"] == [4, 8, 32]
    assert params.resolve("05_sweep", {"concurrency": "8,2"})["concurrency"] == [2, 8]
    assert params.resolve("03_kernel_test", {"num_comms": 8})["num_comms"] == 8


@pytest.mark.parametrize("given, name, allowed", [
    ({"context": "nowhere"}, "context", "local, plan, kube"),
    ({"nodes": 0}, "nodes", ">= 1"),
    ({"run_id": "../../etc"}, "run_id", "letters, digits"),
    ({"run_id": "a/b"}, "run_id", "letters, digits"),
    ({"concurrency": "0,2"}, "concurrency", "integers >= 1"),
    ({"concurrency": -1}, "concurrency", "integers >= 1"),
    ({"context": "local", "nodes": 2}, "nodes", "1 on the local context"),
])
def test_bad_values_name_the_parameter_and_allowed_values(given, name, allowed):
    stage = "05_sweep"
    with pytest.raises(params.ParameterError) as err:
        params.resolve(stage, given)
    assert err.value.name == name and allowed in str(err.value) and repr(given[name]) in str(err.value)


@pytest.mark.parametrize("given, name", [
    ({"num_topk": 9, "num_experts": 8}, "num_topk"),
    ({"num_experts": 7, "num_topk": 2, "ranks": 2}, "num_experts"),
    ({"num_comms": 0}, "num_comms"),
])
def test_kernel_rules_across_parameters(given, name):
    with pytest.raises(params.ParameterError) as err:
        params.resolve("03_kernel_test", given)
    assert err.value.name == name


def test_unknown_parameter_is_refused():
    with pytest.raises(params.ParameterError, match="the parameters of 00_cluster"):
        params.resolve("00_cluster", {"concurrency": "1"})


# ---- evidence --------------------------------------------------------------------------------
def test_gate_rules():
    with pytest.raises(ValueError, match="needs its reason"):
        Gate("g", "SKIP")
    with pytest.raises(ValueError, match="not in"):
        Gate("g", "WARN")
    assert evidence.gate("g", False, 1, 2).reason == "observed 1, expected 2"


def test_write_new_refuses_to_overwrite(tmp_path):
    path = evidence.write_json_new(tmp_path / "a.json", {"x": 1})
    with pytest.raises(EvidenceError, match="append-only"):
        evidence.write_json_new(path, {"x": 2})
    assert evidence.read_json(path) == {"x": 1}


def test_seal_is_checked_by_sha256sum(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f.txt").write_text("hello\n")
    (tmp_path / "run.json").write_text("{}\n")
    evidence.seal(tmp_path)
    assert subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=tmp_path).returncode == 0
    assert evidence.verify(tmp_path) == []
    (tmp_path / "d" / "f.txt").write_text("changed\n")
    assert evidence.verify(tmp_path) == ["d/f.txt: changed"]
    assert subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=tmp_path,
                          capture_output=True).returncode != 0


# ---- redaction -------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    "token hf_plantedSECRET0123456789 here",
    "AKIA" + "ABCDEFGHIJKLMNOP",  # built, so no key-shaped string sits in the repository
    "Authorization: Bearer abcdefghijklmnop123",
    "--hf-token=abcdefgh12345",
    "ghp_abcdefghijklmnopqrstuvwxyz0123",
])
def test_token_shapes_are_masked(text):
    out = redact.redact(text)
    assert "[REDACTED]" in out
    for secret in ("plantedSECRET", "ABCDEFGHIJKLMNOP", "abcdefghijklmnop123", "abcdefgh12345",
                   "abcdefghijklmnopqrstuvwxyz0123"):
        assert secret not in out


def test_secret_named_env_values_are_masked_anywhere(monkeypatch):
    monkeypatch.setenv("MY_DB_PASSWORD", "correct-horse-battery")
    assert redact.redact("x=correct-horse-battery;") == "x=[REDACTED];"
    assert redact.redact_argv(["--password", "correct-horse-battery"]) == ["--password", "[REDACTED]"]
    assert redact.redact_env({"API_KEY": "zzz", "PATH": "/bin"}) == {"API_KEY": "[REDACTED]",
                                                                     "PATH": "/bin"}


@pytest.mark.parametrize("flag", [
    "--token", "--hf-token", "--HF_TOKEN", "--api-key", "--apikey", "--api_key", "--password",
    "--passwd", "--passphrase", "--aws-secret-access-key", "--secret-key", "--client-secret",
    "--credentials", "--credential", "--auth", "-token", "--authtoken",
])
def test_argv_value_after_a_secret_flag_is_masked(flag):
    assert redact.redact_argv(["serve", flag, "plain-value-42", "--port", "8000"]) == [
        "serve", flag, "[REDACTED]", "--port", "8000"]


@pytest.mark.parametrize("flag", [
    "--num-tokens", "--tokenizer", "--max-tokens", "--cb-max-batch-tokens",
    "--synthetic-input-tokens-mean", "--output-tokens-mean", "--keyfile", "--token-count",
    "--auth-mode", "--secret-name-prefix",
])
def test_argv_value_after_a_flag_merely_containing_a_secret_word_is_kept(flag):
    argv = ["aiperf", flag, "128", "--tokenizer-trust-remote-code"]
    assert redact.redact_argv(argv) == argv


def test_argv_boolean_flag_then_flag_keeps_both():
    argv = ["aiperf", "--use-server-token-count", "--num-tokens", "128"]
    assert redact.redact_argv(argv) == argv
    assert redact.redact_argv(["serve", "--no-auth", "--port", "8000"]) == [
        "serve", "--no-auth", "--port", "8000"]


def test_argv_token_after_a_non_secret_flag_is_still_masked_by_shape_and_value(monkeypatch):
    assert redact.redact_argv(["--num-tokens", "hf_abcdefghijklmnop"]) == ["--num-tokens",
                                                                          "[REDACTED]"]
    monkeypatch.setenv("MY_SERVICE_PASSWORD", "correct-horse-battery")
    assert redact.redact_argv(["--tokenizer", "correct-horse-battery"]) == ["--tokenizer",
                                                                           "[REDACTED]"]


def test_argv_flag_equals_value_goes_through_redact():
    assert redact.redact_argv(["--hf-token=abcdefgh12345", "--num-tokens=128"]) == [
        "--hf-token=[REDACTED]", "--num-tokens=128"]


@pytest.mark.parametrize("text", [
    "NCCL_DEBUG=INFO dispatch 14.8 us, 128 tokens, key-value cache of 128 blocks",
    "--num-tokens 128 --use-server-token-count --output-tokens-mean 16",
    '{"max_new_tokens": 16, "num_tokens": 128, "tokenizer": "x", "total_tokens": 40}',
    "the token count per case",
    '{"time_to_first_token": {"avg": 1.0}, "time_to_second_token": [1, 2], "first_token": 12}',
    '"inter_token_latency": 3.5, "use_token": true, "last_token": null',
])
def test_ordinary_text_is_left_alone(text):
    assert redact.redact(text) == text


@pytest.mark.parametrize("text, secret", [
    ('{"token": "abcdefgh12345678"}', "abcdefgh12345678"),
    ('{"access_token": "abcdefgh12345678"}', "abcdefgh12345678"),
    ("--hf-token abcdefgh12345", "abcdefgh12345"),
    ("HF_TOKEN=abcdefgh12345", "abcdefgh12345"),
    ("password: hunter2hunter2", "hunter2hunter2"),
    ("eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0abcd.c2lnbmF0dXJlc2ln", "eyJzdWIiOiJ4In0abcd"),
])
def test_secret_keys_and_jwts_are_masked(text, secret):
    assert secret not in redact.redact(text)


def test_real_evidence_passes_redaction_unchanged():
    """Redaction must never corrupt real data: every shared fixture (AIPerf exports of two
    versions, vLLM logs, DeepEP test_ep logs) comes out of it byte for byte."""
    from pathlib import Path

    fixtures = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
    files = [p for p in fixtures.rglob("*") if p.is_file()]
    assert len(files) > 50, f"fixtures missing at {fixtures}"
    changed = [p for p in files if redact.redact(p.read_text(errors="replace"))
               != p.read_text(errors="replace")]
    assert changed == []


def test_engine_decides_the_local_defaults():
    cpu = params.resolve("05_sweep", {"engine": "transformers"})
    gpu = params.resolve("05_sweep", {"engine": "vllm"})
    assert cpu["concurrency"] == [1, 2, 4] and gpu["concurrency"] == [4, 8, 32]
    assert (gpu["output_tokens"], gpu["input_tokens"]) == (128, 120)
    assert params.resolve("06_multicomm", {"engine": "vllm"})["ab_repeats"] == 3
    # a value given wins over the engine's default
    assert params.resolve("05_sweep", {"engine": "vllm", "concurrency": "2"})["concurrency"] == [2]


def _recorded_stage(tmp_path, name: str, recorded_params: dict, outputs_version=2) -> Path:
    import json as _json

    run = tmp_path / "r"
    (run / name).mkdir(parents=True)
    run_json = {"outputs_version": outputs_version} if outputs_version else {}
    (run / "run.json").write_text(_json.dumps(run_json))
    (run / name / "params.json").write_text(_json.dumps(recorded_params))
    evidence.seal(run)  # replay opens only a sealed run (evidence.require_intact)
    return run


def test_a_replay_takes_exactly_the_recorded_parameters(tmp_path):
    """DESIGN.md, Reference runs age: a run replays while today's stage takes the parameters it
    recorded, at its values; nothing recorded is renamed, defaulted or forgiven."""
    from lib.core.stage import open_replay

    now = params.resolve("06_multicomm", {"engine": "transformers"})
    run = _recorded_stage(tmp_path, "06_multicomm", json.loads(evidence.dumps(dict(now))))
    stage = open_replay("06_multicomm", now, run)
    assert stage["engine"] == "transformers" and stage["concurrency"] == [1, 2, 4]
    with pytest.raises(ReplayMismatch, match="'concurrency' = \\[9\\] but the recorded run used"):
        open_replay("06_multicomm", {**now, "concurrency": [9]}, run)


def test_a_run_recorded_before_a_parameter_existed_no_longer_replays(tmp_path):
    """A stage that takes a parameter its recorded run lacks: the replay is refused, naming the
    parameter and what to do (re-record, or show the run through its evidence)."""
    from lib.core.stage import open_replay

    now = params.resolve("03_kernel_test", {"context": "kube", "ab_repeats": "2"})
    old = {k: v for k, v in json.loads(evidence.dumps(dict(now))).items()
           if k != "transport_ab"}
    run = _recorded_stage(tmp_path, "03_kernel_test", old)
    with pytest.raises(ReplayMismatch, match="takes parameter 'transport_ab', which the "
                                             "recorded run r did not record.*re-record"):
        open_replay("03_kernel_test", now, run)


@pytest.mark.parametrize("version", [None, 1])
def test_a_run_of_an_older_outputs_version_is_shown_not_replayed(tmp_path, version):
    from lib.core.stage import open_replay

    now = params.resolve("00_cluster", {})
    run = _recorded_stage(tmp_path, "00_cluster", json.loads(evidence.dumps(dict(now))),
                          outputs_version=version)
    with pytest.raises(ReplayMismatch, match="outputs version 1, today's is 2.*shown through "
                                             "its evidence"):
        open_replay("00_cluster", now, run)


@pytest.mark.parametrize("value, parsed", [(True, True), ("true", True), ("False", False),
                                           ("0", False), ("yes", True)])
def test_warmup_full_batch_values(value, parsed):
    assert params.resolve("05_sweep", {"warmup_full_batch": value})["warmup_full_batch"] is parsed


def test_warmup_full_batch_refuses_other_values():
    with pytest.raises(params.ParameterError, match="'warmup_full_batch'.*true or false"):
        params.resolve("06_multicomm", {"warmup_full_batch": "sometimes"})


_REPLAY_CHILD = """
import os, signal, sys
sys.path.insert(0, sys.argv[3])
from pathlib import Path
from lib.stages import registry as params
from lib.core.stage import open_replay
stage = open_replay("05_sweep", params.resolve("05_sweep", {"engine": "transformers"}),
                    Path(sys.argv[1]))
print(stage.run_dir, flush=True)
if sys.argv[2] == "killed":  # as a Jupyter kernel is stopped: no exit hooks run
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[2] == "held":
    sys.stdin.read()
"""


def _replay_in_child(run, how, tmp, **popen):
    from lib.core.door import REPO_ROOT
    env = {**os.environ, "TMPDIR": str(tmp)}
    return subprocess.Popen([sys.executable, "-c", _REPLAY_CHILD, str(run), how, str(REPO_ROOT)],
                            env=env, stdout=subprocess.PIPE, text=True, **popen)


def test_a_replay_copy_left_by_a_killed_process_is_removed_by_the_next_replay(tmp_path):
    """nbval and papermill stop their kernels without exit hooks; each replayed notebook used
    to leave its copy of the recorded run in /tmp. The next replay removes copies whose process
    is gone, keeps a live process's copy and any copy whose name carries no pid."""
    import json as _json

    from lib.core.stage import SHADOW_PREFIX, remove_orphan_shadows

    run, tmp = tmp_path / "recorded", tmp_path / "tmp"
    (run / "05_sweep").mkdir(parents=True)
    tmp.mkdir()
    (run / "run.json").write_text('{"outputs_version": 2}')
    (run / "05_sweep" / "params.json").write_text(
        _json.dumps(params.resolve("05_sweep", {"engine": "transformers"}).as_dict()))
    evidence.seal(run)  # replay opens only a sealed run (evidence.require_intact)
    unnamed = tmp / f"{SHADOW_PREFIX}k3x9q2ab"  # made before pids were in the name
    unnamed.mkdir()

    killed = _replay_in_child(run, "killed", tmp)
    killed_copy = Path(killed.stdout.readline().strip())
    assert killed.wait(timeout=60) == -9
    assert killed_copy.is_dir() and killed_copy.name == "recorded"
    assert killed_copy.parent.name.startswith(f"{SHADOW_PREFIX}{killed.pid}-")

    held = _replay_in_child(run, "held", tmp, stdin=subprocess.PIPE)
    held_copy = Path(held.stdout.readline().strip())
    try:
        assert not killed_copy.parent.exists()  # the second replay removed the orphan
        assert held_copy.is_dir() and unnamed.is_dir()
        assert remove_orphan_shadows(tmp) == []  # the held process is alive: its copy stays
        assert held_copy.is_dir()
    finally:
        held.communicate("", timeout=60)
    assert held.returncode == 0
    assert not held_copy.parent.exists()  # a normal exit removes its own copy, as before
    assert unnamed.is_dir() and sorted(p.name for p in tmp.iterdir()) == [unnamed.name]
