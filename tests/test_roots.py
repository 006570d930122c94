"""Stage 01 against real sources served on 127.0.0.1: a git daemon, a PEP 503 index holding a
real wheel, a plain HTTP server with an artifact and a patch, and a registry / Hub stand-in that
speaks the v2 bearer-token flow. VERIFIED, MISSING, DRIFT and SKIP are each shown on them."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from lib.stages import registry as params
from lib.roots import pins
from lib.roots import verify as roots
from lib.core.door import Door, read_transcript
from lib.core.stage import Stage
from lib.stages import roots as roots_stage

STAGE = "01_public_roots"
PHANTOM = "b306af06afd4dbfa0000000000000000000000aa"
TOKEN = "test-registry-token-0123456789"
DIGEST = "sha256:" + "1" * 64
MOVED_DIGEST = "sha256:" + "2" * 64
GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
           "GIT_CONFIG_NOSYSTEM": "1", "HOME": os.environ.get("HOME", "/tmp")}


# ---- servers ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen | None = None, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def stop(proc: subprocess.Popen):
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def git(*args, cwd=None) -> str:
    return subprocess.run(["git", *args], cwd=cwd, env=GIT_ENV, check=True, text=True,
                          capture_output=True).stdout.strip()


@pytest.fixture(scope="module")
def git_server(tmp_path_factory):
    """A bare repository behind `git daemon`: commit A (pinned), commit B (the pull request's
    head after it moved), tag v1.0 -> A (annotated), tag v2.0 -> B (moved from A)."""
    base = tmp_path_factory.mktemp("git")
    bare = base / "repo.git"
    git("init", "-q", "--bare", str(bare))
    git("config", "uploadpack.allowAnySHA1InWant", "true", cwd=bare)
    work = base / "work"
    git("clone", "-q", str(bare), str(work))
    (work / "README").write_text("one\n")
    git("add", "README", cwd=work)
    git("commit", "-q", "-m", "pinned commit", cwd=work)
    a = git("rev-parse", "HEAD", cwd=work)
    git("push", "-q", "origin", "HEAD:refs/heads/main", f"{a}:refs/pull/1/head", cwd=work)
    git("tag", "-a", "-m", "release", "v1.0", a, cwd=work)
    (work / "README").write_text("two\n")
    git("commit", "-q", "-am", "pull request moved on", cwd=work)
    b = git("rev-parse", "HEAD", cwd=work)
    git("tag", "v2.0", b, cwd=work)
    git("push", "-q", "-f", "origin", f"{b}:refs/pull/1/head", "v1.0", "v2.0", cwd=work)
    port = free_port()
    proc = subprocess.Popen(
        ["git", "daemon", "--export-all", f"--base-path={base}", f"--port={port}",
         "--listen=127.0.0.1", "--reuseaddr", "--informative-errors", str(base)],
        env=GIT_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_listening(port, proc)
        yield {"url": f"git://127.0.0.1:{port}/repo.git", "a": a, "b": b,
               "missing_repo": f"git://127.0.0.1:{port}/nope.git"}
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def files_server(tmp_path_factory):
    """`python -m http.server` over a PEP 503 index holding a real wheel built here, an artifact
    of known size, and a patch of known sha256."""
    root = tmp_path_factory.mktemp("www")
    project = tmp_path_factory.mktemp("tinyroot")
    (project / "tinyroot").mkdir()
    (project / "tinyroot" / "__init__.py").write_text("VALUE = 1\n")
    (project / "pyproject.toml").write_text(textwrap.dedent("""\
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "tinyroot"
        version = "1.0.0"
        [tool.setuptools]
        packages = ["tinyroot"]
        """))
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(dist), str(project)], check=True,
                   env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
    [wheel] = dist.glob("tinyroot-1.0.0-*.whl")
    simple = root / "simple" / "tinyroot"
    simple.mkdir(parents=True)
    shutil.copy(wheel, simple / wheel.name)
    (root / "simple" / "index.html").write_text('<a href="tinyroot/">tinyroot</a>\n')
    (simple / "index.html").write_text(f'<a href="{wheel.name}">{wheel.name}</a>\n')
    (root / "files").mkdir()
    artifact = root / "files" / "installer-1.0.tar.gz"
    artifact.write_bytes(bytes(range(256)) * 48 + b"end")
    patch = root / "files" / "fix.patch"
    patch.write_text("--- a/x\n+++ b/x\n@@ -1 +1 @@\n-one\n+two\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                             "127.0.0.1", "--directory", str(root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_listening(port, proc)
        yield {"base": f"http://127.0.0.1:{port}", "index": f"http://127.0.0.1:{port}/simple",
               "artifact": f"http://127.0.0.1:{port}/files/installer-1.0.tar.gz",
               "size": artifact.stat().st_size, "patch": f"http://127.0.0.1:{port}/files/fix.patch",
               "patch_sha256": hashlib.sha256(patch.read_bytes()).hexdigest()}
    finally:
        stop(proc)


class _RegistryHandler(BaseHTTPRequestHandler):
    """registry-1.docker.io's anonymous flow (401 + Www-Authenticate Bearer, a token endpoint,
    manifests with Docker-Content-Digest) and the Hub's revision API, on 127.0.0.1."""

    manifests = {"13.0.0-devel-ubuntu22.04": DIGEST, DIGEST: DIGEST, "moved": MOVED_DIGEST,
                 MOVED_DIGEST: MOVED_DIGEST}
    hf = {"Org/model": "c" * 40}
    seen: list = []

    def log_message(self, *args):  # quiet
        pass

    def _send(self, status, body=b"", headers=None):
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        url = urllib.parse.urlparse(self.path)
        self.seen.append((self.command, url.path, self.headers.get("Authorization")))
        port = self.server.server_address[1]
        if url.path == "/token":
            query = urllib.parse.parse_qs(url.query)
            assert query == {"service": ["registry.docker.io"],
                             "scope": ["repository:nvidia/cuda:pull"]}, query
            body = json.dumps({"token": TOKEN, "access_token": TOKEN, "expires_in": 300})
            return self._send(200, body.encode(), {"Content-Type": "application/json"})
        if url.path.startswith("/v2/"):
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                challenge = (f'Bearer realm="http://127.0.0.1:{port}/token",'
                             'service="registry.docker.io",scope="repository:nvidia/cuda:pull"')
                body = json.dumps({"errors": [{"code": "UNAUTHORIZED"}]}).encode()
                return self._send(401, body, {"Www-Authenticate": challenge,
                                              "Content-Type": "application/json"})
            reference = url.path.rsplit("/manifests/", 1)[-1]
            if reference in self.manifests:
                return self._send(200, b"{}", {
                    "Docker-Content-Digest": self.manifests[reference],
                    "Content-Type": "application/vnd.oci.image.index.v1+json"})
            body = json.dumps({"errors": [{"code": "MANIFEST_UNKNOWN"}]}).encode()
            return self._send(404, body, {"Content-Type": "application/json"})
        if url.path.startswith("/api/models/"):
            model, _, revision = url.path[len("/api/models/"):].partition("/revision/")
            if self.hf.get(model) == revision:
                return self._send(200, json.dumps({"id": model, "sha": revision}).encode())
            return self._send(404, json.dumps({"error": "Revision Not Found"}).encode())
        return self._send(404)


@pytest.fixture(scope="module")
def api_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RegistryHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield {"base": f"http://127.0.0.1:{server.server_address[1]}",
               "seen": _RegistryHandler.seen}
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def closed_url():
    port = free_port()  # bound, then closed: nothing listens there
    return f"127.0.0.1:{port}"


@pytest.fixture
def door(tmp_path):
    return Door(tmp_path / "run", STAGE)


def pin(**fields):
    return {"level": "cited", "source": "a test source", **fields}


def scratch(door):
    return door.run_dir / STAGE / "scratch" / "x"


# ---- refusals before any call ---------------------------------------------------------------------
def test_short_sha_is_refused_before_any_call(door):
    with pytest.raises(roots.RootError, match="short SHA"):
        roots.verify_git_commit(door, "deepep", pin(), repo="git://127.0.0.1:9/r.git",
                                commit="b306af06", scratch=scratch(door))
    with pytest.raises(roots.RootError, match="short SHA"):
        roots.verify_pr_head(door, "pr", pin(), repo="git://127.0.0.1:9/r.git", pr=1,
                             head="c2e773d")
    data = {"schema": 1, "pins": {"deepep": pin(kind="git", repo="https://github.com/x/y",
                                               commit="b306af06afd412c8")}}
    with pytest.raises(pins.PinsError, match="not a full 40-hex SHA"):
        roots.verify_all(door, data, scratch=scratch(door))
    assert read_transcript(door.transcript_path) == []  # nothing was asked of the world


def test_a_row_without_a_reason_is_refused():
    with pytest.raises(ValueError, match="needs its reason"):
        roots.Row("x", "git-commit", "s", "p", None, "SKIP")


# ---- git ------------------------------------------------------------------------------------------
def test_git_commit_verified_missing_and_unreachable(door, git_server, closed_url):
    ok = roots.verify_git_commit(door, "deepep", pin(), repo=git_server["url"],
                                 commit=git_server["a"], scratch=scratch(door))
    assert (ok.status, ok.resolved) == ("VERIFIED", git_server["a"])
    assert ok.evidence and all((door.run_dir / e).exists() for e in ok.evidence)
    assert not scratch(door).exists()  # the temporary repository is gone

    phantom = roots.verify_git_commit(door, "phantom", pin(), repo=git_server["url"],
                                      commit=PHANTOM, scratch=scratch(door))
    assert phantom.status == "MISSING" and "not our ref" in phantom.reason

    no_repo = roots.verify_git_commit(door, "repo", pin(), repo=git_server["missing_repo"],
                                      commit=git_server["a"], scratch=scratch(door))
    assert no_repo.status == "MISSING" and "no such repository" in no_repo.reason

    down = roots.verify_git_commit(door, "down", pin(), repo=f"git://{closed_url}/repo.git",
                                   commit=git_server["a"], scratch=scratch(door))
    assert down.status == "SKIP" and down.reason.startswith("unreachable:")
    assert "refused" in down.reason.lower()


def test_git_tag_verified_and_drift(door, git_server):
    ok = roots.verify_git_tag(door, "lib", pin(), repo=git_server["url"], tag="v1.0",
                              commit=git_server["a"])
    assert (ok.status, ok.resolved) == ("VERIFIED", git_server["a"])  # annotated, peeled
    moved = roots.verify_git_tag(door, "lib", pin(), repo=git_server["url"], tag="v2.0",
                                 commit=git_server["a"])
    assert (moved.status, moved.resolved) == ("DRIFT", git_server["b"])
    gone = roots.verify_git_tag(door, "lib", pin(), repo=git_server["url"], tag="v9",
                                commit=git_server["a"])
    assert gone.status == "MISSING"


def test_pull_request_head_drift_is_reported(door, git_server, closed_url):
    moved = roots.verify_pr_head(door, "pr", pin(taken="2026-08-13"), repo=git_server["url"],
                                 pr=1, head=git_server["a"])
    assert (moved.status, moved.resolved) == ("DRIFT", git_server["b"])
    assert "moved since it was pinned on 2026-08-13" in moved.reason
    same = roots.verify_pr_head(door, "pr", pin(), repo=git_server["url"], pr=1,
                                head=git_server["b"])
    assert same.status == "VERIFIED"
    absent = roots.verify_pr_head(door, "pr", pin(), repo=git_server["url"], pr=9,
                                  head=git_server["a"])
    assert absent.status == "MISSING"
    down = roots.verify_pr_head(door, "pr", pin(), repo=f"git://{closed_url}/repo.git", pr=1,
                                head=git_server["a"])
    assert down.status == "SKIP"


# ---- PyPI -----------------------------------------------------------------------------------------
def test_pypi_version_verified_missing_and_unreachable(door, files_server, closed_url):
    index = files_server["index"]
    ok = roots.verify_pypi(door, "tiny", pin(), package="tinyroot", version="1.0.0",
                           index_url=index)
    assert (ok.status, ok.resolved) == ("VERIFIED", "1.0.0")
    wrong = roots.verify_pypi(door, "tiny", pin(), package="tinyroot", version="9.9.9",
                              index_url=index)
    assert wrong.status == "MISSING" and "9.9.9 is not among" in wrong.reason
    absent = roots.verify_pypi(door, "tiny", pin(), package="no-such-package", version="1.0",
                               index_url=index)
    assert absent.status == "MISSING"
    down = roots.verify_pypi(door, "tiny", pin(), package="tinyroot", version="1.0.0",
                             index_url=f"http://{closed_url}/simple")
    assert down.status == "SKIP" and "refused" in down.reason.lower()
    # pip asked only the index given: no config file, no machine-wide find-links
    [entry] = [e for e in read_transcript(door.transcript_path) if e["kind"] == "run"][:1]
    assert "--isolated" in entry["key"] and entry["env"] == {"PIP_CONFIG_FILE": os.devnull}


# ---- HTTP artifacts, patches, the Hub ------------------------------------------------------------
def test_url_answers_with_its_size(door, files_server, closed_url):
    ok = roots.verify_url(door, "efa", pin(), url=files_server["artifact"],
                          size=files_server["size"])
    assert (ok.status, ok.resolved) == ("VERIFIED", f"{files_server['size']} bytes")
    changed = roots.verify_url(door, "efa", pin(), url=files_server["artifact"], size=1)
    assert changed.status == "FAIL" and "differs" in changed.reason
    gone = roots.verify_url(door, "efa", pin(), url=files_server["base"] + "/files/nope.tar.gz")
    assert gone.status == "MISSING"
    down = roots.verify_url(door, "efa", pin(), url=f"http://{closed_url}/x.tar.gz")
    assert down.status == "SKIP" and down.reason.startswith(f"unreachable: {closed_url}")


def test_patch_sha256(door, files_server):
    ok = roots.verify_patch(door, "p", pin(), url=files_server["patch"],
                            sha256=files_server["patch_sha256"])
    assert ok.status == "VERIFIED"
    bad = roots.verify_patch(door, "p", pin(), url=files_server["patch"], sha256="0" * 64)
    assert bad.status == "FAIL"


def test_hf_revision(door, api_server):
    ok = roots.verify_hf_revision(door, "model", pin(), model="Org/model", revision="c" * 40,
                                  endpoint=api_server["base"])
    assert (ok.status, ok.resolved) == ("VERIFIED", "c" * 40)
    gone = roots.verify_hf_revision(door, "model", pin(), model="Org/model", revision="d" * 40,
                                    endpoint=api_server["base"])
    assert gone.status == "MISSING"


# ---- the registry's bearer-token flow ------------------------------------------------------------
def test_registry_token_flow_verified_missing_and_drift(door, api_server, closed_url):
    api_server["seen"].clear()
    tag, digest = roots.verify_image(door, "base", pin(), registry=api_server["base"],
                                     repository="nvidia/cuda", tag="13.0.0-devel-ubuntu22.04",
                                     digest=DIGEST)
    assert (tag.status, tag.resolved) == ("VERIFIED", DIGEST)
    assert (digest.status, digest.resolved) == ("VERIFIED", DIGEST)
    seen = api_server["seen"]
    assert seen[0][2] is None and seen[1][1] == "/token"  # 401 first, then the token endpoint
    assert seen[2][2] == f"Bearer {TOKEN}" and seen[3][2] == f"Bearer {TOKEN}"  # token reused
    for path in door.run_dir.rglob("*"):  # the pull token was used, and recorded only masked
        assert not path.is_file() or TOKEN not in path.read_text(errors="replace"), path

    [missing] = roots.verify_image(door, "base", pin(), registry=api_server["base"],
                                   repository="nvidia/cuda", tag="99.0-nope")
    assert missing.status == "MISSING" and "404" in missing.reason
    moved = roots.verify_image(door, "base", pin(), registry=api_server["base"],
                               repository="nvidia/cuda", tag="moved", digest=DIGEST)
    assert [r.status for r in moved] == ["DRIFT", "VERIFIED"]
    down = roots.verify_image(door, "base", pin(), registry=f"http://{closed_url}",
                              repository="nvidia/cuda", tag="13.0.0-devel-ubuntu22.04",
                              digest=DIGEST)
    assert [r.status for r in down] == ["SKIP", "SKIP"]


def test_challenge_parsing_matches_docker_hub():
    header = ('Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
              'scope="repository:nvidia/cuda:pull"')
    assert roots.parse_challenge(header) == {
        "realm": "https://auth.docker.io/token", "service": "registry.docker.io",
        "scope": "repository:nvidia/cuda:pull"}
    assert roots.parse_challenge('Basic realm="x"') == {}


# ---- the stage, end to end, then replayed ---------------------------------------------------------
def local_pins(git_server, files_server, api_server, closed_url) -> dict:
    return {"schema": 1, "pins": {
        "deepep": pin(kind="git", repo=git_server["url"], commit=git_server["a"], ref="v1.0",
                      level="served-e2e", source="served end-to-end here, a test"),
        "phantom": pin(kind="git", repo=git_server["url"], commit=PHANTOM),
        "pr": pin(kind="pr_head", repo=git_server["url"], pr=1, head=git_server["a"],
                  taken="2026-08-13"),
        "tiny": pin(kind="pypi", package="tinyroot", version="1.0.0", local="cu0",
                    index=files_server["index"]),
        "artifact": pin(kind="url", url=files_server["artifact"], size=files_server["size"]),
        "base": pin(kind="image", registry=api_server["base"], repository="nvidia/cuda",
                    tag="13.0.0-devel-ubuntu22.04", digest=DIGEST),
        "model": pin(kind="hf", model="Org/model", revision="c" * 40,
                     endpoint=api_server["base"]),
        "offline": pin(kind="git", repo=f"git://{closed_url}/repo.git", commit=git_server["a"]),
        "later": pin(kind="git", repo="https://github.com/x/y", status="unresolved",
                     reason="only a short SHA is published"),
    }}


def make_stage(run_dir: Path, replay: bool = False) -> Stage:
    door = Door(run_dir, STAGE, replay=replay)
    return Stage(STAGE, params.resolve(STAGE, {}), run_dir, door, run_dir if replay else None)


def test_stage_gates_every_status_and_replays(tmp_path, git_server, files_server, api_server,
                                              closed_url, monkeypatch):
    data = local_pins(git_server, files_server, api_server, closed_url)
    # the PyPI row of a pypi pin asks PyPI itself: point it at the local index for the test
    monkeypatch.setattr(roots, "PYPI_INDEX", files_server["index"])
    pins_file = tmp_path / "pins.yaml"
    pins_file.write_text(yaml.safe_dump(data, sort_keys=False))
    run_dir = tmp_path / "run"
    stage = make_stage(run_dir)
    table = roots_stage.run(stage, pins_path=pins_file)

    by = {(r["root"], r["kind"]): r for r in table["rows"]}
    assert by[("deepep", "git-commit")]["status"] == "VERIFIED"
    assert by[("deepep", "git-tag")]["status"] == "VERIFIED"
    assert by[("phantom", "git-commit")]["status"] == "MISSING"
    assert by[("pr", "pr-head")]["status"] == "DRIFT"
    assert by[("tiny", "pypi-index")]["status"] == "MISSING"  # 1.0.0+cu0 is not served
    assert by[("artifact", "url")]["status"] == "VERIFIED"
    assert by[("base", "image-tag")]["status"] == "VERIFIED"
    assert by[("model", "hf-revision")]["status"] == "VERIFIED"
    assert by[("offline", "git-commit")]["status"] == "SKIP"
    assert by[("later", "git")]["status"] == "SKIP" and "unresolved" in by[("later", "git")]["reason"]
    assert by[("deepep", "git-commit")]["level"] == "served-e2e"
    assert table["pins_digest"] == hashlib.sha256(pins_file.read_bytes()).hexdigest()
    # pins without sets: the table and gates of a run recorded before sets existed, unchanged
    assert set(table) == {"pins_digest", "rows", "counts", "problems"}
    assert not [g for g in stage.gates if g.gate.startswith("pin set")]

    gates = {g.gate: g for g in stage.gates}
    assert gates["pins.yaml follows its schema"].status == "PASS"
    assert gates["deepep: git-commit"].status == "PASS"
    assert gates["phantom: git-commit"].status == "FAIL"
    drift = gates["pr: pr-head"]
    assert drift.status == "PASS" and drift.reason.startswith("DRIFT:")
    assert gates["offline: git-commit"].status == "SKIP"
    assert "unreachable" in gates["offline: git-commit"].reason
    assert all("01_public_roots/roots.json" in g.evidence for n, g in gates.items()
               if n != "pins.yaml follows its schema")
    stage.finish()
    recorded = json.loads((run_dir / STAGE / "roots.json").read_text())
    assert recorded == json.loads(json.dumps(table))
    assert not (run_dir / STAGE / "scratch").exists()

    shown = roots_stage.show(stage, recorded)
    assert list(shown.columns) == roots_stage.COLUMNS and len(shown) == len(recorded["rows"])

    # replay: no process runs, the door answers from the transcript, the same table comes out
    pins_file.write_text("schema: 1\npins: {}\n")  # the replay reads the recorded pins instead
    replay = make_stage(run_dir, replay=True)
    again = roots_stage.run(replay, pins_path=pins_file)
    assert again == table
    replay.finish()  # raises unless the gates equal the recorded ones and every call was asked


def test_stage_refuses_bad_pins_before_any_call(tmp_path):
    pins_file = tmp_path / "pins.yaml"
    pins_file.write_text(yaml.safe_dump({"schema": 1, "pins": {"deepep": pin(
        kind="git", repo="https://github.com/deepseek-ai/DeepEP", commit="b306af06")}}))
    stage = make_stage(tmp_path / "run")
    table = roots_stage.run(stage, pins_path=pins_file)
    [only] = stage.gates
    assert only.status == "FAIL" and "not a full 40-hex SHA" in only.reason
    assert table["rows"] == []
    kinds = [e["kind"] for e in read_transcript(tmp_path / "run" / "transcript.jsonl")]
    assert kinds == ["read"]  # the pins file, and nothing else


# ---- the committed pins --------------------------------------------------------------------------
def test_committed_pins_follow_the_schema():
    data = pins.load()
    assert pins.validate(data) == []
    for name, p in pins.items(data):
        assert p["level"] in pins.LEVELS and p["source"], name
        for key in ("commit", "head"):
            if key in p:
                assert pins.FULL_SHA.match(p[key]), (name, key)
    assert data["pins"]["deepep"]["commit"] == "b306af06afd412c88e51e71802951606e40b7358"
    assert data["pins"]["base_image"]["tag"] == "13.0.0-devel-ubuntu22.04"
    assert {p["kind"] for _, p in pins.items(data)} >= {"git", "pypi", "image", "url", "hf",
                                                       "patch", "pr_head"}


def test_pins_validation_names_every_problem():
    bad = {"schema": 1, "pins": {
        "a": {"kind": "git", "level": "measured", "source": "", "repo": "github.com/x",
              "commit": "abc"},
        "b": {"kind": "image", "level": "cited", "source": "s", "registry": "r",
              "repository": "x", "tag": "latest", "digest": "sha256:12"},
        "c": {"kind": "pypi", "level": "cited", "source": "s", "package": "x", "version": "1",
              "python": 3.1},
    }}
    problems = "\n".join(pins.validate(bad))
    for expected in ("level 'measured'", "source is required", "not a URL",
                     "not a full 40-hex SHA", "never latest", "not sha256:<64 hex>",
                     "a quoted CPython version"):
        assert expected in problems


# ---- pin sets: every set verified, each pin asked once, what is missing named ---------------------
def sets_pins(git_server, files_server, closed_url) -> dict:
    """A base set and three more: `fine` (a public commit of its own, a pin dropped), `broken` (a
    release the index does not have, a commit the repository does not serve) and `offline`."""
    return {"schema": 1, "pins": {
        "deepep": pin(kind="git", repo=git_server["url"], commit=git_server["a"]),
        "tiny": pin(kind="pypi", package="tinyroot", version="1.0.0"),
        "fix": pin(kind="patch", url=files_server["patch"], sha256=files_server["patch_sha256"],
                   applies_to="tiny", order=1),
        "artifact": pin(kind="url", url=files_server["artifact"], size=files_server["size"]),
    }, "sets": {
        "base-1": {"base": True, "level": "served-e2e", "source": "the pins above"},
        "fine": {"level": "verified-at-source", "source": "a test", "pins": {
            "deepep": pin(kind="git", repo=git_server["url"], commit=git_server["b"]),
            "artifact": None}},
        "broken": {"level": "cited", "source": "a test", "pins": {
            "tiny": pin(kind="pypi", package="tinyroot", version="9.9.9"),
            "deepep": pin(kind="git", repo=git_server["url"], commit=PHANTOM)}},
        "offline": {"level": "cited", "source": "a test", "pins": {
            "deepep": pin(kind="git", repo=f"git://{closed_url}/repo.git",
                          commit=git_server["a"])}},
    }}


def make_set_stage(run_dir: Path, pin_set: str, replay: bool = False) -> Stage:
    door = Door(run_dir, STAGE, replay=replay)
    # pin_set as a test's pins name it (the registry allows only the committed sets' names)
    resolved = {**params.resolve(STAGE, {}), "pin_set": pin_set}
    return Stage(STAGE, resolved, run_dir, door, run_dir if replay else None)


def test_stage_verifies_every_set_asks_each_pin_once_and_fails_naming_what_is_missing(
        tmp_path, git_server, files_server, closed_url, monkeypatch):
    data = sets_pins(git_server, files_server, closed_url)
    assert pins.validate(data) == []
    monkeypatch.setattr(roots, "PYPI_INDEX", files_server["index"])
    pins_file = tmp_path / "pins.yaml"
    pins_file.write_text(yaml.safe_dump(data, sort_keys=False))
    run_dir = tmp_path / "run"
    stage = make_set_stage(run_dir, "fine")
    table = roots_stage.run(stage, pins_path=pins_file)

    by = {(r["root"], r["kind"]): r["status"] for r in table["rows"]}
    assert by == {("deepep", "git-commit"): "VERIFIED", ("tiny", "pypi"): "VERIFIED",
                  ("fix", "patch"): "VERIFIED", ("artifact", "url"): "VERIFIED",
                  ("fine/deepep", "git-commit"): "VERIFIED",
                  ("broken/tiny", "pypi"): "MISSING", ("broken/deepep", "git-commit"): "MISSING",
                  ("offline/deepep", "git-commit"): "SKIP"}
    sets = table["sets"]
    assert table["pin_set"] == "fine" and list(sets) == ["base-1", "fine", "broken", "offline"]
    assert sets["fine"]["pins"] == {"deepep": "fine/deepep", "tiny": "tiny", "fix": "fix"}
    # the patch was made for the tiny the broken set replaces: it leaves that set
    assert sets["broken"]["pins"] == {"deepep": "broken/deepep", "tiny": "broken/tiny",
                                      "artifact": "artifact"}
    assert [sets[n]["status"] for n in sets] == ["PASS", "PASS", "FAIL", "SKIP"]

    gates = {g.gate: g for g in stage.gates}
    broken = gates["pin set broken: every pin resolves"]
    assert broken.status == "FAIL"
    assert "broken/tiny (pypi) MISSING: tinyroot==9.9.9" in broken.reason
    assert f"broken/deepep (git-commit) MISSING: repo@{PHANTOM}" in broken.reason
    assert gates["broken/tiny: pypi"].status == "FAIL"
    assert gates["broken/deepep: git-commit"].status == "FAIL"
    fine = gates["pin set fine: every pin resolves"]
    assert fine.status == "PASS" and "this run's pin_set" in fine.reason
    assert gates["pin set base-1: every pin resolves"].status == "PASS"
    offline = gates["pin set offline: every pin resolves"]
    assert offline.status == "SKIP" and "offline/deepep" in offline.reason
    assert gates["pin_set names a set of pins.yaml"].status == "PASS"

    # each pin asked once: the inherited ones are not asked again
    calls = [e for e in read_transcript(run_dir / "transcript.jsonl")]
    pip_calls = [e for e in calls if e["kind"] == "run" and "index" in e["key"]]
    assert len(pip_calls) == 2  # tinyroot 1.0.0 (the base set) and 9.9.9 (broken)
    assert len([e for e in calls if e["kind"] == "http" and "fix.patch" in str(e["key"])]) == 1

    stage.finish()
    shown = roots_stage.show(stage, json.loads((run_dir / STAGE / "roots.json").read_text()))
    assert list(shown.columns) == ["root", "sets", *roots_stage.COLUMNS[1:]]
    serves = dict(zip(shown["root"], shown["sets"]))
    assert serves["tiny"] == "base-1, fine, offline"
    assert serves["artifact"] == "base-1, broken, offline"
    assert serves["broken/tiny"] == "broken"

    pins_file.write_text("schema: 1\npins: {}\n")  # the replay reads the recorded pins
    replay = make_set_stage(run_dir, "fine", replay=True)
    assert roots_stage.run(replay, pins_path=pins_file) == table
    replay.finish()


def test_a_pin_set_that_is_not_in_the_pins_read_fails(tmp_path, git_server, files_server,
                                                        closed_url, monkeypatch):
    data = sets_pins(git_server, files_server, closed_url)
    data["sets"] = {"base-1": data["sets"]["base-1"]}
    monkeypatch.setattr(roots, "PYPI_INDEX", files_server["index"])
    pins_file = tmp_path / "pins.yaml"
    pins_file.write_text(yaml.safe_dump(data, sort_keys=False))
    stage = make_set_stage(tmp_path / "run", "current")
    table = roots_stage.run(stage, pins_path=pins_file)
    chosen = {g.gate: g for g in stage.gates}["pin_set names a set of pins.yaml"]
    assert chosen.status == "FAIL" and "'current' is not a set of the pins read" in chosen.reason
    assert table["pin_set"] == "current" and list(table["sets"]) == ["base-1"]


def test_a_set_with_a_short_sha_is_refused_before_any_call(tmp_path, git_server, files_server,
                                                           closed_url):
    data = sets_pins(git_server, files_server, closed_url)
    data["sets"]["fine"]["pins"]["deepep"]["commit"] = "d4f41e4e93"
    pins_file = tmp_path / "pins.yaml"
    pins_file.write_text(yaml.safe_dump(data, sort_keys=False))
    stage = make_set_stage(tmp_path / "run", "fine")
    table = roots_stage.run(stage, pins_path=pins_file)
    [only] = stage.gates
    assert only.status == "FAIL" and "sets.fine.pins.deepep: commit 'd4f41e4e93'" in only.reason
    assert table["rows"] == []
    kinds = [e["kind"] for e in read_transcript(tmp_path / "run" / "transcript.jsonl")]
    assert kinds == ["read"]
