"""The pins file (pins.yaml at the repository root): the single source of truth for every root.

`load()` / `digest()` read the committed file; `loads(text)` parses text a stage read through its
door (so a replay sees the pins the run recorded). `validate` checks the schema described at the
top of pins.yaml; `dockerfile_args` gives every Dockerfile ARG the pins dictate, which stage 02
and tests/test_image.py compare with the Dockerfile.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import yaml

from lib.core.errors import PinsError

PINS_PATH = Path(__file__).resolve().parents[2] / "pins.yaml"

KINDS = ("git", "pypi", "image", "url", "hf", "patch", "pr_head")
LEVELS = ("served-e2e", "build-only", "cited")
PIN_STATUSES = ("pinned", "unresolved")
FULL_SHA = re.compile(r"^[0-9a-f]{40}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
ARG_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")

# Fields each kind needs when its status is `pinned`.
REQUIRED = {
    "git": ("repo", "commit"),
    "pypi": ("package", "version"),
    "image": ("registry", "repository", "tag", "digest"),
    "url": ("url",),
    "hf": ("model", "revision"),
    "patch": ("sha256", "applies_to", "order"),  # and one of url / path (_shape_problems)
    "pr_head": ("repo", "pr", "head"),
}
COMMON = ("kind", "level", "source", "status", "reason", "resolved_by", "note", "dockerfile")
OPTIONAL = {
    "git": ("ref", "patched_tree"),
    "pypi": ("local", "index", "python"),
    "image": (),
    "url": ("version", "sha256", "size"),
    "hf": ("endpoint",),
    "patch": ("url", "path", "upstream_commit"),
    "pr_head": ("taken",),
}
COMPUTED = ("ref", "full_version")


def load(path: Path = PINS_PATH) -> dict:
    with open(path, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def loads(text: str) -> dict:
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise PinsError("pins.yaml: the top level must be a mapping with `schema` and `pins`")
    return data


def digest(path: Path = PINS_PATH) -> str | None:
    """sha256 of the pins file as committed, recorded in every run.json."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if Path(path).exists() else None


def text_digest(text: str) -> str:
    """sha256 of pins text as read (equals digest() of the same file)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def items(data: dict) -> list[tuple[str, dict]]:
    """(name, pin) in file order."""
    return list((data.get("pins") or {}).items())


def status(pin: dict) -> str:
    return pin.get("status", "pinned")


def image_ref(pin: dict) -> str:
    """repository:tag@digest (tag alone when the digest is not pinned)."""
    ref = f"{pin['repository']}:{pin['tag']}"
    return f"{ref}@{pin['digest']}" if pin.get("digest") else ref


def full_version(pin: dict) -> str:
    return f"{pin['version']}+{pin['local']}" if pin.get("local") else str(pin["version"])


def field(pin: dict, name: str) -> str:
    """A pin's field as a string, including the computed `ref` of an image and `full_version`."""
    if name == "ref" and pin.get("kind") == "image":
        return image_ref(pin)
    if name == "full_version" and pin.get("kind") == "pypi":
        return full_version(pin)
    if name not in pin or pin[name] is None:
        raise KeyError(name)
    return str(pin[name])


def validate(data: Any) -> list[str]:
    """Every schema problem in the pins data (empty when it is well formed)."""
    if not isinstance(data, dict):
        return ["the top level must be a mapping with `schema` and `pins`"]
    problems = []
    if data.get("schema") != 1:
        problems.append(f"schema: {data.get('schema')!r}, expected 1")
    pins = data.get("pins")
    if not isinstance(pins, dict) or not pins:
        return problems + ["pins: a non-empty mapping of name -> pin is required"]
    args_seen: dict[str, str] = {}
    for name, pin in pins.items():
        problems += [f"pins.{name}: {p}" for p in _validate_pin(pin, pins)]
        for arg in (pin.get("dockerfile") or {}) if isinstance(pin, dict) else {}:
            if arg in args_seen:
                problems.append(f"pins.{name}: ARG {arg} is also mapped by pins.{args_seen[arg]}")
            args_seen[arg] = name
    build_args = data.get("build_args") or {}
    if not isinstance(build_args, dict):
        problems.append("build_args: a mapping of ARG -> value is required")
        build_args = {}
    for arg, value in build_args.items():
        if not ARG_NAME.match(str(arg)):
            problems.append(f"build_args.{arg}: not an ARG name")
        if arg in args_seen:
            problems.append(f"build_args.{arg}: also mapped by pins.{args_seen[arg]}")
        if not isinstance(value, str):
            problems.append(f"build_args.{arg}: quote the value ({value!r}) so YAML keeps it text")
    return problems


def _validate_pin(pin: Any, pins: dict) -> list[str]:
    if not isinstance(pin, dict):
        return ["a pin must be a mapping"]
    kind = pin.get("kind")
    if kind not in KINDS:
        return [f"kind {kind!r} is not one of {', '.join(KINDS)}"]
    problems = []
    if pin.get("level") not in LEVELS:
        problems.append(f"level {pin.get('level')!r} is not one of {', '.join(LEVELS)}")
    if not pin.get("source"):
        problems.append("source is required (who measured or cites it, where, when)")
    if status(pin) not in PIN_STATUSES:
        problems.append(f"status {status(pin)!r} is not one of {', '.join(PIN_STATUSES)}")
    unknown = sorted(set(pin) - set(COMMON) - set(REQUIRED[kind]) - set(OPTIONAL[kind]))
    if unknown:
        problems.append(f"unknown keys for kind {kind}: {', '.join(unknown)}")
    if status(pin) == "unresolved":
        if not pin.get("reason"):
            problems.append("an unresolved pin needs its reason")
        if pin.get("dockerfile"):
            problems.append("an unresolved pin cannot feed the Dockerfile")
        return problems
    missing = [k for k in REQUIRED[kind] if pin.get(k) in (None, "")]
    if missing:
        problems.append(f"missing {', '.join(missing)} for kind {kind}")
    problems += _shape_problems(kind, pin, pins)
    for arg, name in (pin.get("dockerfile") or {}).items():
        if not ARG_NAME.match(str(arg)):
            problems.append(f"dockerfile: {arg!r} is not an ARG name")
        try:
            field(pin, name)
        except KeyError:
            problems.append(f"dockerfile.{arg}: field {name!r} is not in this pin")
    return problems


def _shape_problems(kind: str, pin: dict, pins: dict) -> list[str]:
    problems = []
    for key in ("commit", "head", "patched_tree", "upstream_commit"):
        value = pin.get(key)
        if value is not None and not FULL_SHA.match(str(value)):
            problems.append(f"{key} {value!r} is not a full 40-hex SHA")
    if kind == "hf" and pin.get("revision") and not FULL_SHA.match(str(pin["revision"])):
        problems.append(f"revision {pin['revision']!r} is not a full 40-hex commit")
    if pin.get("sha256") is not None and not SHA256.match(str(pin["sha256"])):
        problems.append(f"sha256 {pin['sha256']!r} is not 64 hex")
    if kind == "pypi" and "python" in pin:
        value = pin["python"]
        if not isinstance(value, str) or not re.match(r"^3\.\d+$", value):
            problems.append(f"python {value!r}: a quoted CPython version, e.g. \"3.11\"")
    if kind == "image":
        if pin.get("digest") and not DIGEST.match(str(pin["digest"])):
            problems.append(f"digest {pin['digest']!r} is not sha256:<64 hex>")
        if str(pin.get("tag", "")) in ("", "latest"):
            problems.append("tag must be a fixed version, never latest")
    if kind == "patch" and pin.get("applies_to") not in pins:
        problems.append(f"applies_to {pin.get('applies_to')!r} names no pin")
    if kind == "patch" and ("url" in pin) == ("path" in pin):
        problems.append("a patch names exactly one of url (upstream, at a commit) and path "
                        "(this project's own, under patches/)")
    if kind == "patch" and "path" in pin and not re.match(r"^patches/[\w.-]+\.patch$",
                                                          str(pin["path"])):
        problems.append(f"path {pin['path']!r}: a file patches/<name>.patch of this repository")
    for key in ("repo", "url", "index", "endpoint"):
        value = pin.get(key)
        if value is not None and not re.match(r"^(https?|git|file)://", str(value)):
            problems.append(f"{key} {value!r} is not a URL")
    return problems


def check(data: Any) -> dict:
    """`data` when well formed; PinsError listing every problem otherwise."""
    problems = validate(data)
    if problems:
        raise PinsError("pins.yaml has problems:\n  " + "\n  ".join(problems))
    return data


def dockerfile_args(data: dict) -> dict[str, str]:
    """Every Dockerfile ARG the pins dictate: ARG name -> the value it must have."""
    args: dict[str, str] = {}
    for _, pin in items(data):
        for arg, name in (pin.get("dockerfile") or {}).items():
            args[arg] = field(pin, name)
    for arg, value in (data.get("build_args") or {}).items():
        args[arg] = str(value)
    return args


def arg_owner(data: dict) -> dict[str, str]:
    """ARG name -> the pin (or `build_args`) that dictates it, for messages."""
    owner = {arg: name for name, pin in items(data) for arg in (pin.get("dockerfile") or {})}
    owner.update({arg: "build_args" for arg in (data.get("build_args") or {})})
    return owner
