"""Verification of every root at its public source, through the door.

Each check returns a `Row` {root, kind, level, source, pin, resolved, status, reason, evidence}:

- VERIFIED: the source answered and holds what the pin says;
- MISSING: the source answered and does not hold it (a FAIL);
- DRIFT: a moving thing (a pull request's head, a tag, an image tag) no longer equals its pin;
  reported, not a FAIL: the pin itself is immutable;
- SKIP: the source could not be asked (DNS failure, connection refused, no network, a timeout,
  a door without a capability) or the pin is unresolved: never a PASS, always with its reason;
- FAIL: the source answered something this code cannot read as either.

The checks are deterministic given the door's answers: no clock, no socket, no file outside the
run directory is touched except through the door, so a replay re-computes the same rows.
`evidence` names the door's recorded streams (``calls/<stage>/<seq>.<stream>``) behind a row.

Pin sets: `verify_sets` asks every pin a set names that no top-level pin (or earlier set) already
is, as a row whose root is `<set>/<pin>`; `set_verdict` says whether a set resolves, naming what
does not.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lib.core.errors import RootError
from lib.roots import pins as pins_mod
from lib.core.door import REPO_ROOT

STATUSES = ("VERIFIED", "MISSING", "DRIFT", "SKIP", "FAIL")
PYPI_INDEX = "https://pypi.org/simple"
HF_ENDPOINT = "https://huggingface.co"
GIT_TIMEOUT_S = 180.0
PIP_TIMEOUT_S = 90.0
HTTP_TIMEOUT_S = 30.0
GIT_ENV = {"GIT_TERMINAL_PROMPT": "0"}
# pip asks only the index named on its command line: no config file, no PIP_* variable, no
# find-links or extra index of this machine can vouch for a version PyPI does not have.
PIP_ENV = {"PIP_CONFIG_FILE": os.devnull}
# The platform a pinned version must install on: the image's (Ubuntu 22.04, CPython 3.10, x86_64),
# whatever machine runs the check; a pin's `python` names another CPython (a local tool's venv).
TARGET_PYTHON = "3.10"
TARGET_PLATFORMS = (
    "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
    "manylinux_2_18_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64",
)
MANIFEST_ACCEPT = ", ".join((
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
))

# What a git server says when it holds no such commit, ref or repository. GitHub asks for
# credentials (refused: prompts are off) when a repository is absent or private.
_MISSING_GIT = re.compile(
    r"not our ref|no such remote ref|couldn't find remote ref|no such repository|"
    r"repository not found|does not appear to be a git repository|not found|"
    r"could not read username|terminal prompts disabled", re.I)
_UNREACHABLE = re.compile(
    r"could not resolve host|could not resolve hostname|name or service not known|"
    r"temporary failure in name resolution|nodename nor servname|no address associated|"
    r"unable to look up|name resolution|gaierror|connection refused|errno 111|"
    r"failed to connect|unable to connect|network is unreachable|"
    r"no route to host|connection timed out|timed out|timeout|newconnectionerror|"
    r"failed to establish a new connection|connection reset|connection aborted|"
    r"max retries exceeded|proxyerror|retrying \(", re.I)


# The telling part of a long line (pip's retry warning, git's "unable to access '...': ...").
_CAUSES = [re.compile(p, re.I) for p in (
    r"(Failed to establish a new connection: [^'\")\n]+)",
    r"(Could not resolve host(?:name)?:? [^\s'\"]+)",
    r"((?:Connection refused|Connection timed out|Network is unreachable|No route to host|"
    r"Name or service not known|Temporary failure in name resolution)[^'\"\n]*)",
    r"(Failed to connect[^'\"\n]*)",
)]


@dataclass
class Row:
    root: str
    kind: str
    source: str
    pin: str
    resolved: str | None
    status: str
    reason: str = ""
    evidence: list[str] = field(default_factory=list)
    level: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"row {self.root}: status {self.status!r} not in {STATUSES}")
        if self.status in ("SKIP", "MISSING", "DRIFT", "FAIL") and not self.reason:
            raise ValueError(f"row {self.root}: a {self.status} needs its reason")

    def as_dict(self) -> dict:
        return asdict(self)


# ---- small pure helpers -------------------------------------------------------------------------
def require_full_sha(sha: Any, what: str = "commit") -> str:
    """The SHA itself when it is 40 lowercase hex; RootError (before any call) otherwise."""
    text = str(sha or "").strip()
    if not pins_mod.FULL_SHA.match(text):
        shape = "a short SHA" if re.fullmatch(r"[0-9a-fA-F]{4,39}", text) else "not a SHA"
        raise RootError(
            f"{what} {text!r} is {shape}: pins name commits by their full 40-hex SHA (a short "
            "SHA can become ambiguous, and a fetch by SHA needs the whole one); resolve it with "
            "`git rev-parse <short>^{commit}` in a clone")
    return text


def unreachable_reason(text: str) -> str | None:
    """The line saying a source could not be reached (DNS, refused, no network), else None."""
    lines = [line for line in (text or "").splitlines() if _UNREACHABLE.search(line)]
    if not lines:
        return None
    for cause in _CAUSES:
        for line in lines:
            found = cause.search(line)
            if found:
                return _short(found.group(1))
    return _short(lines[0])


def first_line(text: str) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return _short(line)
    return ""


def _short(line: str, limit: int = 240) -> str:
    line = re.sub(r" at 0x[0-9a-f]+", "", line.strip())
    return line if len(line) <= limit else line[:limit] + " ..."


def _evidence(door, result, *streams: str) -> list[str]:
    seq = getattr(result, "seq", -1)
    if seq is None or seq < 0:
        return []
    return [f"calls/{door.stage}/{seq:04d}.{s}" for s in streams]


def _row(name: str, pin: dict, kind: str, shown: str, **fields) -> Row:
    return Row(root=name, kind=kind, source=str(pin.get("source", "")), pin=shown,
               level=str(pin.get("level", "")), **fields)


def _repo_name(url: str) -> str:
    path = urllib.parse.urlparse(url).path.strip("/")
    return path[:-4] if path.endswith(".git") else path


def _http(door, method: str, url: str, headers: dict[str, str] | None = None,
          secret_response: bool = False):
    # every source here is a public index: its versions are kept as they are (door.http)
    if secret_response:  # the answer is a credential: used raw, recorded redacted
        return door.http(method, url, timeout=HTTP_TIMEOUT_S, secret_response=True,
                         public_response=True)
    if headers:
        return door.http(method, url, timeout=HTTP_TIMEOUT_S, headers=headers,
                         public_response=True)
    return door.http(method, url, timeout=HTTP_TIMEOUT_S, public_response=True)


def _headers(result) -> dict[str, str]:
    """Response headers, lower-cased keys ({} when the door does not return headers)."""
    raw = getattr(result, "headers", None) or {}
    try:
        return {str(k).lower(): str(v) for k, v in dict(raw).items()}
    except (TypeError, ValueError):
        return {}


def _http_unreachable(result) -> str | None:
    """"<host>: <cause>" when the request never got an answer for want of a network path."""
    if result.status is None:
        cause = unreachable_reason(result.error or "")
        if cause:
            host = urllib.parse.urlparse(getattr(result, "url", "") or "").netloc
            return f"{host}: {cause}" if host else cause
    return None


def _unreachable_row(name: str, pin: dict, kind: str, shown: str, result, evidence) -> Row | None:
    """The SKIP row of a request that got no answer for want of a network path (None: it got
    one, or failed otherwise). Every HTTP-checked pin kind starts with it."""
    unreachable = _http_unreachable(result)
    if not unreachable:
        return None
    return _row(name, pin, kind, shown, resolved=None, status="SKIP",
                reason=f"unreachable: {unreachable}", evidence=evidence)


# ---- git ----------------------------------------------------------------------------------------
def verify_git_commit(door, name: str, pin: dict, *, repo: str, commit: str, scratch: Path,
                      kind: str = "git-commit") -> Row:
    """A commit exists at its repository: fetched by SHA into a fresh bare repository."""
    commit = require_full_sha(commit, f"{name}: commit")
    shown = f"{_repo_name(repo)}@{commit}"
    scratch = Path(scratch)
    door.run(["git", "init", "-q", "--bare", str(scratch)], timeout=60, env=GIT_ENV)
    try:
        fetched = door.run(
            ["git", "--git-dir", str(scratch), "fetch", "--depth=1", "--no-tags", "-q", repo,
             commit], timeout=GIT_TIMEOUT_S, env=GIT_ENV, check=False)
        evidence = _evidence(door, fetched, "stdout", "stderr")
        text = fetched.stderr + "\n" + fetched.stdout
        if fetched.timed_out:
            return _row(name, pin, kind, shown, resolved=None, status="SKIP",
                        reason=f"unreachable: git fetch timed out after {GIT_TIMEOUT_S:.0f} s",
                        evidence=evidence)
        if fetched.rc != 0:
            return _git_failure(name, pin, kind, shown, text, fetched.rc, evidence)
        typed = door.run(["git", "--git-dir", str(scratch), "cat-file", "-t", commit],
                         timeout=60, env=GIT_ENV, check=False)
        evidence += _evidence(door, typed, "stdout")
        if typed.rc == 0 and typed.stdout.strip() == "commit":
            return _row(name, pin, kind, shown, resolved=commit, status="VERIFIED",
                        reason="fetched by SHA: the repository serves this commit",
                        evidence=evidence)
        return _row(name, pin, kind, shown, resolved=typed.stdout.strip() or None,
                    status="FAIL", reason=f"fetched, but {commit[:12]} is not a commit there "
                    f"(cat-file: {first_line(typed.stdout + typed.stderr)!r})", evidence=evidence)
    finally:
        door.run(["rm", "-rf", str(scratch)], timeout=60, check=False)


def _git_failure(name, pin, kind, shown, text, rc, evidence) -> Row:
    if rc == 127:
        return _row(name, pin, kind, shown, resolved=None, status="FAIL",
                    reason=f"git could not run: {first_line(text)}", evidence=evidence)
    unreachable = unreachable_reason(text)
    missing = _MISSING_GIT.search(text)
    if missing and not unreachable:
        return _row(name, pin, kind, shown, resolved=None, status="MISSING",
                    reason=f"the repository answered: {first_line(_line_with(text, missing))}",
                    evidence=evidence)
    if unreachable:
        return _row(name, pin, kind, shown, resolved=None, status="SKIP",
                    reason=f"unreachable: {unreachable}", evidence=evidence)
    return _row(name, pin, kind, shown, resolved=None, status="FAIL",
                reason=f"git exited {rc}: {first_line(text) or 'no output'}", evidence=evidence)


def _line_with(text: str, match: re.Match) -> str:
    start = text.rfind("\n", 0, match.start()) + 1
    end = text.find("\n", match.end())
    return text[start:end if end >= 0 else None]


def ls_remote(door, repo: str, refs: list[str]):
    """`git ls-remote repo refs...` -> (CallResult, {ref: sha})."""
    result = door.run(["git", "ls-remote", repo, *refs], timeout=GIT_TIMEOUT_S, env=GIT_ENV,
                      check=False)
    found = {}
    for line in result.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and pins_mod.FULL_SHA.match(parts[0]):
            found[parts[1]] = parts[0]
    return result, found


def _ls_remote_row(door, name, pin, kind, shown, repo, refs):
    """Shared handling of an ls-remote call: (row-or-None, found refs, evidence)."""
    result, found = ls_remote(door, repo, refs)
    evidence = _evidence(door, result, "stdout", "stderr")
    if result.timed_out:
        return _row(name, pin, kind, shown, resolved=None, status="SKIP",
                    reason=f"unreachable: git ls-remote timed out after {GIT_TIMEOUT_S:.0f} s",
                    evidence=evidence), found, evidence
    if result.rc != 0:
        return _git_failure(name, pin, kind, shown, result.stderr + "\n" + result.stdout,
                            result.rc, evidence), found, evidence
    return None, found, evidence


def verify_git_tag(door, name: str, pin: dict, *, repo: str, tag: str, commit: str) -> Row:
    """A tag still points at the pinned commit (peeled when annotated); DRIFT when it moved."""
    commit = require_full_sha(commit, f"{name}: commit")
    kind = "git-tag"
    shown = f"{_repo_name(repo)} {tag} -> {commit}"
    ref = f"refs/tags/{tag}"
    row, found, evidence = _ls_remote_row(door, name, pin, kind, shown, repo, [ref, f"{ref}^{{}}"])
    if row:
        return row
    target = found.get(f"{ref}^{{}}") or found.get(ref)
    if target is None:
        return _row(name, pin, kind, shown, resolved=None, status="MISSING",
                    reason=f"the repository has no tag {tag}", evidence=evidence)
    if target == commit:
        return _row(name, pin, kind, shown, resolved=target, status="VERIFIED",
                    reason=f"{tag} points at the pinned commit", evidence=evidence)
    return _row(name, pin, kind, shown, resolved=target, status="DRIFT",
                reason=f"tag {tag} moved: it now points at {target[:12]}, the pin is "
                f"{commit[:12]} (the image checks the commit, so it still builds the pin)",
                evidence=evidence)


def verify_pr_head(door, name: str, pin: dict, *, repo: str, pr: int, head: str) -> Row:
    """An open pull request's head still equals the pinned head; DRIFT when it moved."""
    head = require_full_sha(head, f"{name}: head")
    kind = "pr-head"
    shown = f"{_repo_name(repo)}#{pr} head {head}"
    ref = f"refs/pull/{int(pr)}/head"
    row, found, evidence = _ls_remote_row(door, name, pin, kind, shown, repo, [ref])
    if row:
        return row
    current = found.get(ref)
    if current is None:
        return _row(name, pin, kind, shown, resolved=None, status="MISSING",
                    reason=f"the repository has no {ref}", evidence=evidence)
    if current == head:
        return _row(name, pin, kind, shown, resolved=current, status="VERIFIED",
                    reason=f"#{pr} head is still the pinned commit", evidence=evidence)
    taken = f" since it was pinned on {pin['taken']}" if pin.get("taken") else ""
    return _row(name, pin, kind, shown, resolved=current, status="DRIFT",
                reason=f"#{pr} head moved{taken}: now {current[:12]}, pinned {head[:12]} "
                "(reported, not a FAIL: the pin stays immutable)", evidence=evidence)


# ---- PyPI ---------------------------------------------------------------------------------------
def pip_index_argv(python: str, package: str, index_url: str, target_python: str) -> list[str]:
    """`pip index versions` asking one index, for the target platform, downloading nothing."""
    platforms = [a for p in TARGET_PLATFORMS for a in ("--platform", p)]
    return [python, "-m", "pip", "index", "versions", package, "--isolated",
            "--disable-pip-version-check", "--no-input", "--index-url", index_url,
            "--retries", "1", "--timeout", "15", "--python-version", target_python,
            "--implementation", "cp", *platforms, "--only-binary=:all:"]


def verify_pypi(door, name: str, pin: dict, *, package: str, version: str,
                index_url: str | None = None, python: str | None = None,
                target_python: str = TARGET_PYTHON, kind: str = "pypi") -> Row:
    """A version exists on a package index for the target platform (`pip index versions`:
    under a second, nothing downloaded; pip's warnings on stderr are expected). No index given:
    PYPI_INDEX as the module holds it when called (a test points it at a local index)."""
    python = python or sys.executable
    index_url = index_url or PYPI_INDEX
    where = "PyPI" if index_url == PYPI_INDEX else index_url
    shown = f"{package}=={version} on {where} (CPython {target_python}, linux x86_64)"
    result = door.run(pip_index_argv(python, package, index_url, target_python),
                      timeout=PIP_TIMEOUT_S, env=PIP_ENV, check=False)
    evidence = _evidence(door, result, "stdout", "stderr")
    listed = _available_versions(result.stdout)
    if result.timed_out:
        return _row(name, pin, kind, shown, resolved=None, status="SKIP",
                    reason=f"unreachable: pip timed out after {PIP_TIMEOUT_S:.0f} s",
                    evidence=evidence)
    if result.rc == 0 and listed is not None:
        if version in listed:
            return _row(name, pin, kind, shown, resolved=version, status="VERIFIED",
                        reason=f"listed among {len(listed)} versions (latest {listed[0]})",
                        evidence=evidence)
        return _row(name, pin, kind, shown, resolved=f"latest {listed[0]}" if listed else None,
                    status="MISSING", reason=f"{package} exists but {version} is not among "
                    f"its {len(listed)} listed versions", evidence=evidence)
    unreachable = unreachable_reason(result.stderr)
    if unreachable:
        host = urllib.parse.urlparse(index_url).netloc
        return _row(name, pin, kind, shown, resolved=None, status="SKIP",
                    reason=f"unreachable: {host}: {unreachable}", evidence=evidence)
    if "no matching distribution" in result.stderr.lower():
        return _row(name, pin, kind, shown, resolved=None, status="MISSING",
                    reason=f"the index answered: {first_line(_error_lines(result.stderr))}",
                    evidence=evidence)
    return _row(name, pin, kind, shown, resolved=None, status="FAIL",
                reason=f"pip exited {result.rc}: {first_line(_error_lines(result.stderr))}",
                evidence=evidence)


def _available_versions(stdout: str) -> list[str] | None:
    for line in stdout.splitlines():
        if line.startswith("Available versions:"):
            return [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]
    return None


def _error_lines(stderr: str) -> str:
    """pip's ERROR lines (its WARNING and [notice] lines are noise here)."""
    errors = [l for l in stderr.splitlines() if l.startswith("ERROR")]
    return "\n".join(errors) or stderr


# ---- HTTP artifacts -----------------------------------------------------------------------------
def verify_url(door, name: str, pin: dict, *, url: str, size: int | None = None) -> Row:
    """An HTTPS artifact answers HEAD with 200 and its size (Content-Length)."""
    kind = "url"
    result = _http(door, "HEAD", url)
    evidence = _evidence(door, result, "body")
    skipped = _unreachable_row(name, pin, kind, url, result, evidence)
    if skipped:
        return skipped
    if result.status is None:
        return _row(name, pin, kind, url, resolved=None, status="FAIL",
                    reason=f"no answer: {result.error}", evidence=evidence)
    if result.status == 404 or result.status == 410:
        return _row(name, pin, kind, url, resolved=None, status="MISSING",
                    reason=f"HTTP {result.status}", evidence=evidence)
    if result.status != 200:
        return _row(name, pin, kind, url, resolved=None, status="FAIL",
                    reason=f"HTTP {result.status}", evidence=evidence)
    length = _headers(result).get("content-length")
    if length is None:
        note = ("door.http returns no headers" if not hasattr(result, "headers")
                else "no Content-Length header")
        return _row(name, pin, kind, url, resolved="HTTP 200", status="VERIFIED",
                    reason=f"answers 200; size not observed ({note})", evidence=evidence)
    if size is not None and str(size) != length:
        return _row(name, pin, kind, url, resolved=f"{length} bytes", status="FAIL",
                    reason=f"size {length} bytes differs from the pinned {size}",
                    evidence=evidence)
    return _row(name, pin, kind, url, resolved=f"{length} bytes", status="VERIFIED",
                reason=f"answers 200 with {length} bytes", evidence=evidence)


def verify_patch(door, name: str, pin: dict, *, url: str, sha256: str) -> Row:
    """A patch file answers at its URL and its content has the pinned sha256."""
    kind = "patch"
    shown = f"{url} sha256:{sha256}"
    result = _http(door, "GET", url)
    evidence = _evidence(door, result, "body")
    skipped = _unreachable_row(name, pin, kind, shown, result, evidence)
    if skipped:
        return skipped
    if result.status in (404, 410):
        return _row(name, pin, kind, shown, resolved=None, status="MISSING",
                    reason=f"HTTP {result.status}", evidence=evidence)
    if result.status != 200:
        return _row(name, pin, kind, shown, resolved=None, status="FAIL",
                    reason=f"HTTP {result.status}: {result.error or first_line(result.body)}",
                    evidence=evidence)
    got = hashlib.sha256(result.body.encode("utf-8")).hexdigest()
    if got == sha256:
        return _row(name, pin, kind, shown, resolved=f"sha256:{got}", status="VERIFIED",
                    reason=f"{len(result.body)} characters with the pinned sha256",
                    evidence=evidence)
    return _row(name, pin, kind, shown, resolved=f"sha256:{got}", status="FAIL",
                reason="the content's sha256 differs from the pin (computed on the text the "
                "door returned; the door masks secret-shaped text before returning it)",
                evidence=evidence)


def verify_patch_file(door, name: str, pin: dict, *, path: str, sha256: str,
                      repo_root: Path | None = None) -> Row:
    """This project's own patch (patches/*.patch): the file is in the checkout, with its sha256."""
    kind = "patch"
    shown = f"{path} sha256:{sha256}"
    text = door.read_text((repo_root or REPO_ROOT) / path)
    if text is None:
        return _row(name, pin, kind, shown, resolved=None, status="MISSING",
                    reason=f"{path} is not in this checkout")
    got = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if got == sha256:
        return _row(name, pin, kind, shown, resolved=f"sha256:{got}", status="VERIFIED",
                    reason=f"{len(text)} characters in this checkout, with the pinned sha256")
    return _row(name, pin, kind, shown, resolved=f"sha256:{got}", status="FAIL",
                reason="the file's sha256 differs from the pin")


# ---- Hugging Face -------------------------------------------------------------------------------
def verify_hf_revision(door, name: str, pin: dict, *, model: str, revision: str,
                       endpoint: str = HF_ENDPOINT) -> Row:
    """A model revision exists on the Hub (/api/models/<id>/revision/<rev>)."""
    revision = require_full_sha(revision, f"{name}: revision")
    kind = "hf-revision"
    shown = f"{model}@{revision}"
    url = f"{endpoint.rstrip('/')}/api/models/{model}/revision/{revision}"
    result = _http(door, "GET", url)
    evidence = _evidence(door, result, "body")
    skipped = _unreachable_row(name, pin, kind, shown, result, evidence)
    if skipped:
        return skipped
    if result.status in (401, 404):
        said = "repository absent, private or gated" if result.status == 401 else "not found"
        return _row(name, pin, kind, shown, resolved=None, status="MISSING",
                    reason=f"HTTP {result.status} ({said}): {first_line(result.body)}",
                    evidence=evidence)
    if result.status != 200:
        return _row(name, pin, kind, shown, resolved=None, status="FAIL",
                    reason=f"HTTP {result.status}", evidence=evidence)
    try:
        sha = result.json().get("sha")
    except (ValueError, AttributeError):
        sha = None
    if sha == revision:
        return _row(name, pin, kind, shown, resolved=sha, status="VERIFIED",
                    reason="the Hub serves this revision", evidence=evidence)
    return _row(name, pin, kind, shown, resolved=sha, status="FAIL",
                reason=f"the Hub answered 200 with sha {sha!r}", evidence=evidence)


# ---- container registries (v2 API with the anonymous bearer-token flow) --------------------------
def parse_challenge(header: str) -> dict[str, str]:
    """`Bearer realm="...",service="...",scope="..."` -> {realm, service, scope}."""
    if not header or not header.strip().lower().startswith("bearer"):
        return {}
    return {k.lower(): v for k, v in re.findall(r'(\w+)="([^"]*)"', header)}


class _Registry:
    """One registry conversation: the token it hands out is reused for the next request."""

    def __init__(self, door, base: str):
        self.door, self.base, self.token = door, base, None
        self.evidence: list[str] = []

    def head_manifest(self, repository: str, reference: str):
        """-> (HttpResult, reason-if-it-could-not-be-asked)."""
        url = f"{self.base}/v2/{repository}/manifests/{reference}"
        headers = {"Accept": MANIFEST_ACCEPT}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        result = _http(self.door, "HEAD", url, headers)
        self.evidence += _evidence(self.door, result, "body")
        if result.status != 401 or self.token:
            return result, None
        challenge = parse_challenge(_headers(result).get("www-authenticate", ""))
        if not challenge.get("realm"):
            return result, "HTTP 401 without a Bearer challenge (WWW-Authenticate) to follow"
        query = {k: challenge[k] for k in ("service", "scope") if challenge.get(k)}
        token_url = challenge["realm"] + ("?" + urllib.parse.urlencode(query) if query else "")
        answer = _http(self.door, "GET", token_url, secret_response=True)
        self.evidence += _evidence(self.door, answer, "body")
        if answer.status != 200:
            cause = _http_unreachable(answer)
            return answer, (f"unreachable: {cause}" if cause
                            else f"the auth realm answered HTTP {answer.status}")
        try:
            payload = json.loads(answer.body)
            self.token = payload.get("token") or payload.get("access_token")
        except ValueError:
            self.token = None
        if not self.token:
            return answer, "the auth realm answered without a bearer value"
        headers["Authorization"] = f"Bearer {self.token}"
        result = _http(self.door, "HEAD", url, headers)
        self.evidence += _evidence(self.door, result, "body")
        return result, None


def verify_image(door, name: str, pin: dict, *, registry: str, repository: str, tag: str,
                 digest: str | None = None) -> list[Row]:
    """An image tag exists in its registry (and still names the pinned digest; the digest exists).

    GET/HEAD the manifest; on 401 read WWW-Authenticate (Bearer realm/service/scope), get the
    anonymous token, retry with Authorization. 404 is MISSING; a tag that now names another
    digest is DRIFT (the image uses the digest, which is checked on its own row).
    """
    base = registry if "://" in registry else f"https://{registry}"
    host = urllib.parse.urlparse(base).netloc
    conversation = _Registry(door, base.rstrip("/"))
    rows = []
    shown = f"{host}/{repository}:{tag}" + (f" -> {digest}" if digest else "")
    rows.append(_image_row(conversation, name, pin, "image-tag", shown, repository, tag, digest))
    if digest:
        shown = f"{host}/{repository}@{digest}"
        rows.append(_image_row(conversation, name, pin, "image-digest", shown, repository,
                               digest, digest))
    return rows


def _image_row(conv: _Registry, name, pin, kind, shown, repository, reference, digest) -> Row:
    start = len(conv.evidence)
    result, cannot = conv.head_manifest(repository, reference)
    evidence = conv.evidence[start:]
    skipped = _unreachable_row(name, pin, kind, shown, result, evidence)
    if skipped:
        return skipped
    if cannot:
        return _row(name, pin, kind, shown, resolved=None, status="SKIP", reason=cannot,
                    evidence=evidence)
    if result.status == 404:
        return _row(name, pin, kind, shown, resolved=None, status="MISSING",
                    reason=f"HTTP 404: the registry has no manifest {reference}",
                    evidence=evidence)
    if result.status == 401:
        return _row(name, pin, kind, shown, resolved=None, status="FAIL",
                    reason="HTTP 401 even when authenticated (repository absent or private)",
                    evidence=evidence)
    if result.status != 200:
        return _row(name, pin, kind, shown, resolved=None, status="FAIL",
                    reason=f"HTTP {result.status}: {result.error or ''}".strip(),
                    evidence=evidence)
    served = _headers(result).get("docker-content-digest")
    if kind == "image-tag" and digest and served and served != digest:
        return _row(name, pin, kind, shown, resolved=served, status="DRIFT",
                    reason=f"tag {reference} now names {served[:19]}..., the pin is "
                    f"{digest[:19]}... (the image is built FROM the digest; reported, not a "
                    "FAIL)", evidence=evidence)
    if kind == "image-digest" and served and served != digest:
        return _row(name, pin, kind, shown, resolved=served, status="FAIL",
                    reason=f"asked for {digest}, the registry answered {served}",
                    evidence=evidence)
    what = "the tag exists" if kind == "image-tag" else "the digest exists"
    if not served:
        note = ("door.http returns no headers" if not hasattr(result, "headers")
                else "no Docker-Content-Digest header")
        return _row(name, pin, kind, shown, resolved="HTTP 200", status="VERIFIED",
                    reason=f"{what} (digest not observed: {note})", evidence=evidence)
    return _row(name, pin, kind, shown, resolved=served, status="VERIFIED",
                reason=what + (" and names the pinned digest" if kind == "image-tag" and digest
                               else ""), evidence=evidence)


# ---- one pin, every pin -------------------------------------------------------------------------
def verify_pin(door, name: str, pin: dict, *, scratch: Path, python: str | None = None) -> list[Row]:
    """Every row one pin needs (a git pin with a tag gives two, a torch pin with an index two)."""
    kind = pin.get("kind")
    if pins_mod.status(pin) == "unresolved":
        return [_row(name, pin, str(kind), "(unresolved)", resolved=None, status="SKIP",
                     reason=f"pin unresolved: {pin.get('reason', 'no reason given')}")]
    if kind == "git":
        rows = [verify_git_commit(door, name, pin, repo=pin["repo"], commit=pin["commit"],
                                  scratch=Path(scratch) / name)]
        if pin.get("ref"):
            rows.append(verify_git_tag(door, name, pin, repo=pin["repo"], tag=pin["ref"],
                                       commit=pin["commit"]))
        return rows
    if kind == "pypi":
        target = str(pin.get("python", TARGET_PYTHON))
        rows = [verify_pypi(door, name, pin, package=pin["package"], version=str(pin["version"]),
                            python=python, target_python=target)]
        if pin.get("index"):
            rows.append(verify_pypi(door, name, pin, package=pin["package"],
                                    version=pins_mod.full_version(pin), index_url=pin["index"],
                                    python=python, target_python=target, kind="pypi-index"))
        return rows
    if kind == "image":
        return verify_image(door, name, pin, registry=pin["registry"],
                            repository=pin["repository"], tag=str(pin["tag"]),
                            digest=pin.get("digest"))
    if kind == "url":
        return [verify_url(door, name, pin, url=pin["url"], size=pin.get("size"))]
    if kind == "patch" and "path" in pin:
        return [verify_patch_file(door, name, pin, path=pin["path"], sha256=pin["sha256"])]
    if kind == "patch":
        return [verify_patch(door, name, pin, url=pin["url"], sha256=pin["sha256"])]
    if kind == "hf":
        return [verify_hf_revision(door, name, pin, model=pin["model"],
                                   revision=str(pin["revision"]),
                                   endpoint=pin.get("endpoint", HF_ENDPOINT))]
    if kind == "pr_head":
        return [verify_pr_head(door, name, pin, repo=pin["repo"], pr=pin["pr"],
                               head=pin["head"])]
    raise RootError(f"{name}: kind {kind!r} is not one of {', '.join(pins_mod.KINDS)}")


def preflight(data: dict) -> None:
    """Refuse malformed pins (short SHAs included) before any call is made."""
    pins_mod.check(data)
    for name, pin in pins_mod.items(data):
        if pins_mod.status(pin) == "unresolved":
            continue
        for key in ("commit", "head"):
            if key in pin:
                require_full_sha(pin[key], f"{name}: {key}")
        if pin.get("kind") == "hf":
            require_full_sha(pin["revision"], f"{name}: revision")


def verify_all(door, data: dict, *, scratch: Path, python: str | None = None) -> list[Row]:
    preflight(data)
    rows: list[Row] = []
    for name, pin in pins_mod.items(data):
        rows += verify_pin(door, name, pin, scratch=scratch, python=python)
    return rows


# ---- pin sets -----------------------------------------------------------------------------------
FAILING = ("MISSING", "FAIL")


def set_root(set_name: str, pin_name: str) -> str:
    """The root name of a pin a set names itself: `<set>/<pin>` (a top-level pin keeps its name)."""
    return f"{set_name}/{pin_name}"


def verify_sets(door, data: dict, *, scratch: Path,
                python: str | None = None) -> tuple[list[Row], dict[str, dict]]:
    """Every pin of every set that no earlier row verified: (the new rows, each set's pins).

    The top-level pins (the base set) are verify_all's, asked already. Sets are walked in file
    order; a pin whose pins.pin_key equals one already asked (a top-level pin, or an earlier
    set's) is not asked again: the set points at that pin's root. Each set's entry:
    {"level", "base", "pins": {pin name: root}}. Deterministic given the door's answers."""
    verified: dict[tuple, str] = {}
    for name, pin in pins_mod.items(data):
        verified.setdefault(pins_mod.pin_key(pin), name)
    rows: list[Row] = []
    sets: dict[str, dict] = {}
    for set_name in pins_mod.set_names(data):
        spec = data["sets"][set_name] or {}
        members: dict[str, str] = {}
        for pin_name, pin in pins_mod.set_pins(data, set_name).items():
            key = pins_mod.pin_key(pin)
            if key not in verified:
                root = set_root(set_name, pin_name)
                rows += verify_pin(door, root, pin, scratch=scratch, python=python)
                verified[key] = root
            members[pin_name] = verified[key]
        sets[set_name] = {"level": str(spec.get("level", "")), "base": bool(spec.get("base")),
                          "pins": members}
    return rows, sets


def set_verdict(members: dict[str, str], rows: list[Row]) -> tuple[str, dict[str, int], str]:
    """(FAIL | SKIP | PASS, counts of the set's rows by status, the reason naming what decided it).

    FAIL when a row of the set is MISSING or FAIL (each named with what it pinned); SKIP when none
    is but a row could not be asked (an unreachable source is never a PASS); PASS otherwise."""
    by_root: dict[str, list[Row]] = {}
    for row in rows:
        by_root.setdefault(row.root, []).append(row)
    mine = [row for root in dict.fromkeys(members.values()) for row in by_root.get(root, [])]
    counts = {s: 0 for s in STATUSES}
    for row in mine:
        counts[row.status] += 1
    failing = [r for r in mine if r.status in FAILING]
    if failing:
        return "FAIL", counts, "; ".join(f"{r.root} ({r.kind}) {r.status}: {r.pin}: {r.reason}"
                                         for r in failing)
    skipped = [r for r in mine if r.status == "SKIP"]
    if skipped:
        return "SKIP", counts, (f"{len(skipped)} of {len(mine)} checks could not be asked: "
                                + ", ".join(sorted({r.root for r in skipped})))
    return "PASS", counts, f"all {len(mine)} checks VERIFIED or DRIFT"


def summarize(rows: list[Row]) -> dict[str, int]:
    counts = {s: 0 for s in STATUSES}
    for row in rows:
        counts[row.status] += 1
    return counts
