"""The pins file (pins.yaml at the repository root): the single source of truth for every root.

`load()` / `digest()` read the committed file; `loads(text)` parses text a stage read through its
door (so a replay sees the pins the run recorded). `validate` checks the schema described at the
top of pins.yaml; `dockerfile_args` gives every Dockerfile ARG the pins dictate, which stage 02
and tests/test_image.py compare with the Dockerfile.

Pin sets (pins.yaml `sets:`): named, complete stacks. The top-level `pins:` are the base set
(`base: true`, the stack measured so far) exactly as every reader has always read them; each
other set names only what it changes: a pin replaced (a whole pin), dropped (`null`) or added.
`select(data, name)` gives a set as pins data of the same shape (so `items`, `validate`,
`dockerfile_args` work on it), `set_pins` its pins, `set_rows` / `set_overview` the rows the
book shows, `pin_set_of(run_json)` the set a recorded run used (runs recorded before sets
existed used `RECORDED_BEFORE_SETS`).
"""
from __future__ import annotations

import copy
import hashlib
import re
from pathlib import Path
from typing import Any

import yaml

from lib.core.errors import PinsError

PINS_PATH = Path(__file__).resolve().parents[2] / "pins.yaml"

KINDS = ("git", "pypi", "image", "url", "hf", "patch", "pr_head")
# served-e2e: a serve used it; build-only: built or checked, not served; verified-at-source: read
# here at its public source (a wheel's METADATA, a release's sdist, a repository snapshot), never
# run; cited: taken from a named public source, not read at its own source here.
LEVELS = ("served-e2e", "build-only", "verified-at-source", "cited")
# A set's level: the strongest claim true of the set as a whole.
SET_LEVELS = ("served-e2e", "verified-at-source", "cited")
SET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{0,62}$")
SET_KEYS = ("base", "level", "source", "note", "pins")
# The set every run recorded before pin sets existed used (their run.json has no "pin_set").
RECORDED_BEFORE_SETS = "seed-2026-07"
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
COMMON = ("kind", "level", "source", "status", "reason", "resolved_by", "note", "dockerfile",
          "sets")
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
# What a pin of each kind is, for telling two pins apart: two pins with the same key verify the
# same thing at the same source (stage 01 asks once).
KEY_FIELDS = {
    "git": ("repo", "commit", "ref"),
    "pypi": ("package", "version", "local", "index", "python"),
    "image": ("registry", "repository", "tag", "digest"),
    "url": ("url", "size"),
    "hf": ("model", "revision", "endpoint"),
    "patch": ("url", "path", "sha256"),
    "pr_head": ("repo", "pr", "head"),
}


# pins.yaml parsed once per version of the file: the book reads it for every run it lists, and
# a pure-Python parse of it costs about 0.2 s (libyaml's loader, where built, a tenth of that)
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_parsed: dict[tuple, dict] = {}


def load(path: Path = PINS_PATH) -> dict:
    """pins.yaml as a fresh dict (callers may change it): parsed again only when the file's
    size or modification time changed."""
    stat = Path(path).stat()
    key = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _parsed:
        with open(path, encoding="utf-8") as fh:
            _parsed.clear()
            _parsed[key] = yaml.load(fh, Loader=_SAFE_LOADER)
    return copy.deepcopy(_parsed[key])


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
    problems += _set_problems(data)
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
    if "sets" in pin and (not isinstance(pin["sets"], list) or not pin["sets"]
                          or not all(isinstance(n, str) for n in pin["sets"])):
        problems.append(f"sets {pin['sets']!r}: a non-empty list of set names")
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


# ---- pin sets ----------------------------------------------------------------------------------
def has_sets(data: Any) -> bool:
    return isinstance(data, dict) and bool(data.get("sets"))


def set_names(data: dict) -> list[str]:
    """The sets in file order ([] when the pins define none)."""
    return list(data.get("sets") or {}) if isinstance(data, dict) else []


def base_set(data: dict) -> str | None:
    """The set the top-level pins are (`base: true`); None when the pins define no sets."""
    found = [name for name, spec in (data.get("sets") or {}).items()
             if isinstance(spec, dict) and spec.get("base")]
    return found[0] if len(found) == 1 else None


def set_pins(data: dict, name: str) -> dict[str, dict]:
    """The pins of set `name`, in file order: the top-level pins, then what the set adds.

    A set's entry replaces a top-level pin of the same name (a whole pin) or drops it (null). A
    top-level pin with `sets:` belongs only to the sets it names. A patch whose `applies_to` pin
    the set replaces or drops leaves the set unless its `sets:` names the set (a patch is made
    for one source; that it applies to another must be said)."""
    sets = data.get("sets") or {}
    if name not in sets:
        known = ", ".join(sets) or "none (pins.yaml defines no sets)"
        raise PinsError(f"pin set {name!r} is not in pins.yaml; sets: {known}")
    overrides = (sets[name] or {}).get("pins") or {}
    resolved: dict[str, dict] = {}
    for pin_name, pin in (data.get("pins") or {}).items():
        if pin_name in overrides:
            if overrides[pin_name] is not None:
                resolved[pin_name] = overrides[pin_name]
            continue
        named = pin.get("sets") if isinstance(pin, dict) else None
        if named is not None and name not in named:
            continue
        if (isinstance(pin, dict) and pin.get("kind") == "patch"
                and pin.get("applies_to") in overrides and named is None):
            continue
        resolved[pin_name] = pin
    for pin_name, pin in overrides.items():
        if pin_name not in (data.get("pins") or {}) and pin is not None:
            resolved[pin_name] = pin
    return resolved


def select(data: dict, name: str) -> dict:
    """Set `name` as pins data of the same shape as the file (schema, pins, build_args)."""
    selected = {"schema": data.get("schema"), "pins": set_pins(data, name)}
    if "build_args" in data:
        selected["build_args"] = data["build_args"]
    return selected


def pin_key(pin: dict) -> tuple:
    """What a pin verifies (KEY_FIELDS); an unresolved pin is never the same as another."""
    kind = pin.get("kind")
    if status(pin) != "pinned" or kind not in KEY_FIELDS:
        return (kind, "unresolved", id(pin))
    return (kind, *(str(pin.get(k)) for k in KEY_FIELDS[kind]))


def pin_set_of(run_json: dict) -> str:
    """The pin set a recorded run used: its run.json's "pin_set", or, for a run recorded before
    pin sets existed, RECORDED_BEFORE_SETS (the stack every such run measured)."""
    return (run_json or {}).get("pin_set") or RECORDED_BEFORE_SETS


def describe(pin: dict) -> str:
    """A pin in a few words: vllm==0.26.0, deepseek-ai/DeepEP@d4f41e4e93, a file's name."""
    kind = pin.get("kind")
    if status(pin) != "pinned":
        return f"unresolved: {pin.get('reason', '')}"
    if kind == "pypi":
        return f"{pin['package']}=={full_version(pin)}"
    if kind in ("git", "pr_head"):
        repo = re.sub(r"^[a-z]+://[^/]+/|\.git$", "", str(pin["repo"]))
        if kind == "pr_head":
            return f"{repo}#{pin['pr']} head {str(pin['head'])[:12]}"
        return f"{repo}@{str(pin['commit'])[:12]}" + (f" ({pin['ref']})" if pin.get("ref") else "")
    if kind == "image":
        return image_ref(pin)
    if kind == "url":
        return str(pin.get("version") or pin["url"].rsplit("/", 1)[-1])
    if kind == "hf":
        return f"{pin['model']}@{str(pin['revision'])[:12]}"
    if kind == "patch":
        return str(pin.get("path") or pin["url"].rsplit("/", 1)[-1])
    return str(kind)


def set_rows(data: dict | None = None) -> list[dict[str, str]]:
    """One row per pin of every set, for the book: set, set_level, pin, kind, what (describe),
    level, source, and `as` ("the base set" when the set takes the top-level pin unchanged,
    "this set" when the set names it itself)."""
    data = data if data is not None else load()
    rows = []
    for name in set_names(data):
        spec = data["sets"][name] or {}
        own = (spec.get("pins") or {})
        for pin_name, pin in set_pins(data, name).items():
            rows.append({"set": name, "set_level": str(spec.get("level", "")), "pin": pin_name,
                         "kind": str(pin.get("kind", "")), "what": describe(pin),
                         "level": str(pin.get("level", "")), "source": str(pin.get("source", "")),
                         "as": "this set" if pin_name in own else "the base set"})
    return rows


OVERVIEW_ROLES = ("vllm", "torch", "nccl", "nvshmem", "deepep", "efa_installer", "aiperf_public")


def set_overview(data: dict | None = None) -> list[dict[str, str]]:
    """One row per set, for the book's table of sets: set, level, base (yes/''), the pins of
    OVERVIEW_ROLES in a few words ('' when the set has none), this project's patches in the
    set, source and note."""
    data = data if data is not None else load()
    rows = []
    for name in set_names(data):
        spec = data["sets"][name] or {}
        pins = set_pins(data, name)
        row = {"set": name, "level": str(spec.get("level", "")),
               "base": "yes" if spec.get("base") else ""}
        for role in OVERVIEW_ROLES:
            row[role] = describe(pins[role]) if role in pins else ""
        row["patches"] = ", ".join(n for n, p in pins.items()
                                   if p.get("kind") == "patch" and "path" in p)
        row["source"] = str(spec.get("source", ""))
        row["note"] = str(spec.get("note", ""))
        rows.append(row)
    return rows


def _set_problems(data: dict) -> list[str]:
    """Every problem of the `sets:` section (none when there is none: sets are optional)."""
    if "sets" not in data:
        return []
    sets = data["sets"]
    if not isinstance(sets, dict) or not sets:
        return ["sets: a non-empty mapping of name -> set is required when `sets` is given"]
    problems = []
    top = data.get("pins") or {}
    bases = [n for n, s in sets.items() if isinstance(s, dict) and s.get("base")]
    if len(bases) != 1:
        problems.append(f"sets: exactly one set is the top-level pins (`base: true`), found "
                        f"{len(bases)}: {', '.join(bases) or 'none'}")
    for name, spec in sets.items():
        where, before = f"sets.{name}", len(problems)
        if not SET_NAME.match(str(name)):
            problems.append(f"{where}: a set name is lower-case letters, digits, '.', '-' (at "
                            "most 63, starting with a letter or digit)")
        if not isinstance(spec, dict):
            problems.append(f"{where}: a set must be a mapping")
            continue
        unknown = sorted(set(spec) - set(SET_KEYS))
        if unknown:
            problems.append(f"{where}: unknown keys {', '.join(map(str, unknown))}")
        if spec.get("level") not in SET_LEVELS:
            problems.append(f"{where}: level {spec.get('level')!r} is not one of "
                            f"{', '.join(SET_LEVELS)}")
        if not spec.get("source"):
            problems.append(f"{where}: source is required (what the set is, who pins it, when)")
        own = spec.get("pins")
        if own is not None and not isinstance(own, dict):
            problems.append(f"{where}.pins: a mapping of pin name -> pin (or null: dropped)")
            continue
        own = own or {}
        if spec.get("base") and own:
            problems.append(f"{where}: the base set is the top-level pins as they are; it names "
                            "no pins of its own")
        for pin_name, pin in own.items():
            if pin is None:
                if pin_name not in top:
                    problems.append(f"{where}.pins.{pin_name}: null drops a top-level pin, and "
                                    "there is none of that name")
                continue
            if isinstance(pin, dict) and "sets" in pin:
                problems.append(f"{where}.pins.{pin_name}: `sets` belongs on top-level pins")
            if isinstance(pin, dict) and pin.get("dockerfile"):
                problems.append(f"{where}.pins.{pin_name}: a set's pin maps no Dockerfile ARG "
                                "(the Dockerfile's ARGs are the top-level pins')")
        if len(problems) > before:
            continue
        resolved = set_pins(data, name)
        for pin_name, pin in own.items():
            if pin is not None:
                problems += [f"{where}.pins.{pin_name}: {p}" for p in _validate_pin(pin, resolved)]
        for pin_name, pin in resolved.items():
            if (pin_name not in own and isinstance(pin, dict) and pin.get("kind") == "patch"
                    and pin.get("applies_to") not in resolved):
                problems.append(f"{where}: patch {pin_name} applies to {pin.get('applies_to')!r}, "
                                "which this set drops")
    for pin_name, pin in top.items():
        named = pin.get("sets") if isinstance(pin, dict) else None
        if isinstance(named, list):
            for set_name in named:
                if set_name not in sets:
                    problems.append(f"pins.{pin_name}: sets names {set_name!r}, which is not a "
                                    "set")
            if bases and bases[0] not in named:
                problems.append(f"pins.{pin_name}: a top-level pin is in the base set "
                                f"({bases[0]}); its `sets` must name it")
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
