"""The rules a parameter's value must follow, and how a value is checked (the machinery).

The table of every parameter of every stage, with its rule and its defaults per context, is
lib.stages.registry's (it names facts of the engines and places: vLLM's backends, instance
types). A refused value raises lib.core.errors.ParameterError naming the parameter and its
allowed values, before any effect.

Every rule is bounded (a type; allowed values, or a range with an upper bound; strings and lists
of bounded length) and describes itself: `allowed` is the words the error and the bounds table
say. Each rule also names the values at its bounds that it accepts (`edges`) and values just past
them that it refuses (`beyond`); `hostile_values` adds what every rule refuses (shell and YAML
metacharacters, path traversal, empty and oversized strings, containers). They live here, beside
the bounds they are made from, so a rule cannot change its bounds without its hostile values
following, and a new kind of rule cannot arrive without them (tests/test_params_hostile.py
tries every one through the notebooks' entry point).
"""
from __future__ import annotations

import math
import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from lib.core.errors import ParameterError

# Patterns end in \Z, never $: `$` also matches before a trailing newline ("deepep-repro\n").
# A run id never holds "..": it names a folder under results_dir.
RUN_ID_RULE = re.compile(r"^(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
# Kubernetes names (RFC 1123 labels: namespaces, Services, label values we make)
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
# kubectl context names: what `kubectl config get-contexts` shows for EKS (ARNs included), no
# shell or YAML metacharacters
KUBE_CONTEXT_RULE = re.compile(r"^(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._:/@-]{0,252}\Z")
# Tags that are moved by convention: an image named by one is not the image that was tested.
MOVING_TAGS = ("latest", "stable", "nightly", "edge", "main", "master", "dev")
_IMAGE_COMPONENT = r"[a-z0-9]+(?:(?:\.|_{1,2}|-+)[a-z0-9]+)*"
# An image by digest (repo@sha256:...) or by a tag that is not a moving one (a tag with a
# digest beside it is pinned by the digest). A registry's port only before a '/', so that
# `guide:5000` is the tag 5000, not a port.
_IMAGE_NAME_AT_MOST_255 = (r"(?=(?:[a-z0-9._/-]|:[0-9]+/){1,255}"
                           r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]*)?(?:@sha256:[0-9a-f]{64})?\Z)")
IMAGE_RULE = re.compile(
    rf"^{_IMAGE_NAME_AT_MOST_255}{_IMAGE_COMPONENT}(?::[0-9]{{1,5}}(?=/))?(?:/{_IMAGE_COMPONENT})*"
    rf"(?::(?!(?:{'|'.join(MOVING_TAGS)})(?:@|\Z))[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}}"
    r"(?:@sha256:[0-9a-f]{64})?|@sha256:[0-9a-f]{64})\Z")
# Docker's limits: a name of at most 255 characters (the lookahead above; a registry's port
# counts as one), ':' and a tag of at most 128, '@sha256:' and 64 hex digits.
IMAGE_MAX_CHARS = 255 + 1 + 128 + 8 + 64
# Hugging Face's repo id: org/name, each at most 96 word characters, '.' or '-', starting with
# a letter or digit, ending with a letter, digit or '_', never '--' or '..' (the Hub refuses both)
MODEL_ID_RULE = re.compile(r"^(?!.*(?:--|\.\.))[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
                           r"/[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?\Z")
COMMIT_RULE = re.compile(r"^[0-9a-f]{40}\Z")
SLURM_NAME_RULE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
# An integer as text: ASCII digits only (str.isdigit takes '١' and int() ' 5\n'), at most 19 of
# them (every bound here fits), so a 10,000-digit string is refused before it is parsed.
_INT_TEXT = re.compile(r"-?[0-9]{1,19}\Z")
_NUMBER_TEXT = re.compile(r"[0-9]{1,15}(?:\.[0-9]{1,15})?\Z")

# ---- paths ------------------------------------------------------------------------------------
# Characters a path parameter may hold: none a shell, YAML, PYTHONPATH (':') or a batch script
# would read as anything but a name.
PATH_CHARS = re.compile(r"[A-Za-z0-9._/+@=,-]+\Z")
PATH_MAX_CHARS = 1024
NAME_MAX_CHARS = 255  # one component, as every Linux file system bounds it
# Never a Python environment, a build or a site of packages: the root, pseudo file systems,
# configuration and the boot loader.
NOT_SOFTWARE = ("/", "/boot", "/dev", "/etc", "/proc", "/run", "/sys")
# Written into by no run: the operating system's trees (with everything below them) ...
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32",
                "/lost+found", "/proc", "/run", "/sbin", "/snap", "/sys", "/usr", "/var")
# ... except the scratch space one of them holds,
SCRATCH_IN_SYSTEM_TREES = ("/var/tmp",)
# ... and the roots under which people keep their own folders (each itself, not what is below:
# /home/me/results and /opt/dlami/nvme/hf-cache are fine).
SYSTEM_ROOTS = ("/", "/home", "/media", "/mnt", "/opt", "/root", "/srv", "/tmp")



# ---- what every rule refuses ------------------------------------------------------------------
HUGE_TEXT = "x" * 10_000
# Appended to (or put before) a value the rule accepts: a value with something riding on it.
RIDERS = ("{}; rm -rf /", "{}$(id)", "{}`id`", "{} | id", "{} && id", "{}\n", "{}\nid", "{}\r",
          "$(id){}", "{}: {{", "*{}", "!!python/object/apply:os.system {}", "{}\x00")
METACHARACTERS = ("; rm -rf /", "$(id)", "`id`", "|", "a | id", "&&", "a && b", "\n", "a\nb",
                  ": {", "key: {a: 1}", "*anchor", "&anchor x", "!!python/object/apply:os.system",
                  "[x", "#", "'", '"', "${IFS}", "%s%n")
TRAVERSALS = ("../../etc", "..", "../..", "/etc", "/", "a/../../b", "/etc/passwd", "~/x")
CONTAINERS = ({}, {"value": 1}, {1, 2})


def _ridden(edge: Any) -> list[str]:
    text = ",".join(map(str, edge)) if isinstance(edge, list) else str(edge)
    return [rider.format(text) for rider in RIDERS]


def hostile_values(rule: "Rule") -> list[Any]:
    """Values `rule` must refuse: its own just-past-the-bounds values, its accepted values with
    shell or YAML metacharacters riding on them, and what every rule refuses."""
    values: list[Any] = list(rule.beyond())
    for edge in rule.edges():
        values += _ridden(edge)
    values += [*METACHARACTERS, *TRAVERSALS, HUGE_TEXT, *CONTAINERS]
    if not rule.empty_ok:
        values.append("")
    unique: list[Any] = []
    for value in values:  # each once (1 == True, so compare with the type)
        if not any(type(value) is type(u) and value == u for u in unique):
            unique.append(value)
    return unique


# ---- the rules ----------------------------------------------------------------------------------
class Rule:
    """What a parameter's value may be. `allowed`: the words a person reads (the error, the
    bounds table); `kind`: the table's type column; calling the rule returns the normalised
    value or raises ValueError; `edges()`: values at its bounds it accepts; `beyond()`: values
    just past them (and of the wrong type) it refuses."""
    allowed: str
    kind: str
    empty_ok = False  # whether '' is allowed (it means "not given" where it is)

    def __call__(self, value: Any) -> Any:
        raise NotImplementedError

    def edges(self) -> list[Any]:
        raise NotImplementedError

    def beyond(self) -> list[Any]:
        raise NotImplementedError


_WRONG_NUMBERS = (True, False, math.nan, math.inf, -math.inf, "nan", "inf", "-inf", "1e999",
                  "0x10", "1e3", "١", "１", " 1", "1 ", "+1", "one")


@dataclass(frozen=True)
class Integer(Rule):
    """An int from low to high (ASCII digits as text: papermill and `-p` pass text)."""
    low: int
    high: int
    unit: str = ""  # said after the range, e.g. "(a week)"
    kind = "integer"

    @property
    def allowed(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        return f"an integer >= {self.low} and <= {self.high}{unit}"

    def __call__(self, value: Any) -> int:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, str) and _INT_TEXT.match(value):
            value = int(value)
        if not isinstance(value, int) or not self.low <= value <= self.high:
            raise ValueError
        return value

    def edges(self) -> list[Any]:
        return [self.low, self.high, str(self.low), str(self.high)]

    def beyond(self) -> list[Any]:
        huge = [n for n in (10 ** 9, 10 ** 18, 10 ** 100, -10 ** 9)
                if not self.low <= n <= self.high]
        return [self.low - 1, self.high + 1, str(self.high + 1), *huge, "9" * 10_000,
                float(self.low), self.low + 0.5, *_WRONG_NUMBERS, [self.low], [self.low, self.high]]


@dataclass(frozen=True)
class Number(Rule):
    """A finite number from low to high (a timeout in seconds)."""
    low: float
    high: float
    unit: str = ""
    kind = "number"

    @property
    def allowed(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        return f"a number >= {self.low:g} and <= {self.high:g}{unit}"

    def __call__(self, value: Any) -> float:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, str) and _NUMBER_TEXT.match(value):
            value = float(value)
        if not isinstance(value, (int, float)):
            raise ValueError
        value = float(value)
        if not math.isfinite(value) or not self.low <= value <= self.high:
            raise ValueError
        return value

    def edges(self) -> list[Any]:
        return [self.low, self.high, float(self.low), _decimal(self.low), _decimal(self.high)]

    def beyond(self) -> list[Any]:
        return [self.low - 0.001, 0, -1, self.high + 1, str(self.high + 1), 1e9, 1e300,
                *_WRONG_NUMBERS, [self.low]]


def _decimal(x: float) -> str:
    """x as the decimal text a person types (1e-07 as 0.0000001: exponents are refused text)."""
    return str(int(x)) if float(x).is_integer() else f"{x:.15f}".rstrip("0")


@dataclass(frozen=True)
class OneOf(Rule):
    options: tuple[str, ...]
    kind = "choice"

    @property
    def allowed(self) -> str:
        return "one of " + ", ".join(self.options)

    def __call__(self, value: Any) -> str:
        if not isinstance(value, str) or value not in self.options:
            raise ValueError
        return value

    def edges(self) -> list[Any]:
        return list(self.options)

    def beyond(self) -> list[Any]:
        first = self.options[0]
        return [first.upper(), f" {first}", f"{first} ", first[:-1], first + first,
                [first], (first,), True, 1, 0, 1.0]


_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


@dataclass(frozen=True)
class Flag(Rule):
    kind = "true/false"

    @property
    def allowed(self) -> str:
        return "true or false"

    def __call__(self, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):  # papermill's `-p keep 1`
            return bool(value)
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise ValueError

    def edges(self) -> list[Any]:
        return [True, False, 1, 0, *_TRUE, *_FALSE, "True", "FALSE"]

    def beyond(self) -> list[Any]:
        return [2, -1, 1.0, 0.0, math.nan, "maybe", "on", "off", "y", "true ", " false",
                [True], (False,)]


@dataclass(frozen=True)
class Text(Rule):
    """A string the pattern matches whole, of at most max_chars. `edges` and `beyond` are
    examples at the pattern's bounds (a pattern cannot list them itself)."""
    pattern: re.Pattern
    described: str
    max_chars: int
    examples: tuple[str, ...]  # accepted: the shortest and the longest allowed among them
    refused: tuple[str, ...]  # just past the pattern: too long, a character it excludes
    kind = "text"

    @property
    def allowed(self) -> str:
        return self.described

    def __call__(self, value: Any) -> str:
        if not isinstance(value, str) or len(value) > self.max_chars \
                or not self.pattern.match(value):
            raise ValueError
        return value

    def edges(self) -> list[Any]:
        return list(self.examples)

    def beyond(self) -> list[Any]:
        return [*self.refused, 1, 1.5, True, [self.examples[0]]]


def _under(path: str, trees: Iterable[str]) -> bool:
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in trees)


def system_directory(path: str) -> bool:
    """Whether an absolute, normalised path is a system directory no run writes into."""
    if path in SYSTEM_ROOTS:
        return True
    return _under(path, SYSTEM_TREES) and not _under(path, SCRATCH_IN_SYSTEM_TREES)


@dataclass(frozen=True)
class Folder(Rule):
    """A folder's path: safe characters (PATH_CHARS), bounded, no '..' anywhere (nothing can
    climb out of it), never starting with '-' (an option to whatever takes it).

    `absolute`: only absolute paths (relative ones are taken against `base`). `written`: a run
    writes there, so never a system directory (SYSTEM_TREES, SYSTEM_ROOTS); else only never
    NOT_SOFTWARE. `here`: the folder is on this machine, so the user must be able to write where
    it is or would be made (a cluster's node folders are not).
    Symbolic links are followed: a link into /etc is /etc."""
    absolute: bool
    written: bool
    here: bool
    base: Path | None = None  # relative paths are taken against it (the repository)
    kind = "path"

    @property
    def allowed(self) -> str:
        where = "an absolute path" if self.absolute else \
            "a path (absolute, or relative to the repository)"
        never = (f"never a system directory: {', '.join(SYSTEM_TREES)} or below them (but "
                 f"{', '.join(SCRATCH_IN_SYSTEM_TREES)}), nor {', '.join(SYSTEM_ROOTS)} "
                 "themselves" if self.written else
                 f"never {', '.join(NOT_SOFTWARE)} or below them")
        return (f"{where} of at most {PATH_MAX_CHARS} characters: letters, digits, "
                f"'/', '.', '_', '-', '+', '@', '=', ',' (no '..', not starting with '-'), "
                f"{never}" + (", where you can write" if self.here else ""))

    def __call__(self, value: Any) -> str:
        if not isinstance(value, str) or not value or len(value) > PATH_MAX_CHARS \
                or not PATH_CHARS.match(value) or value.startswith("-"):
            raise ValueError
        parts = value.split("/")
        if ".." in parts or any(len(p) > NAME_MAX_CHARS for p in parts):
            raise ValueError
        if self.absolute and not value.startswith("/"):
            raise ValueError
        full = value if value.startswith("/") else str((self.base or Path.cwd()) / value)
        for path in {posixpath.normpath("/" + full.lstrip("/")), os.path.realpath(full)}:
            if system_directory(path) if self.written else _is_not_software(path):
                raise ValueError
        if self.here and not _writable(Path(os.path.realpath(full))):
            raise ValueError
        return value

    def edges(self) -> list[Any]:
        longest = "/tmp/" + "/".join(["a" * NAME_MAX_CHARS] * 3)
        longest += "/" + "b" * (PATH_MAX_CHARS - len(longest) - 1)
        edges = ["/tmp/guide-results", longest, "/var/tmp/guide", "/tmp/a_b-c.d+e@f=g,h"]
        if not self.absolute:
            edges += ["results", "a"]
        if not self.written:
            edges += ["/usr/local/guide", "/opt"]
        return edges

    def beyond(self) -> list[Any]:
        refused = ["/", "/etc", "/etc/", "/etc/.", "//etc", "/./etc", "/proc/self", "/sys/x",
                   "/dev", "/boot", "/tmp/../etc", "results/../../etc", "a/..", "../x",
                   "-rf", "a b", "a:b", "a;b", "a\tb", "~", "a\x00b", "/tmp/" + "a" * (
                       NAME_MAX_CHARS + 1), "/tmp/" + "a/" * PATH_MAX_CHARS, 1, True, ["/tmp"]]
        if self.written:
            refused += ["/usr", "/usr/local/results", "/var", "/var/lib/x", "/bin", "/sbin",
                        "/lib", "/lib64", "/run/x", "/snap", "/home", "/opt", "/mnt", "/root",
                        "/srv", "/tmp", "/var/tmp/../../etc"]
        if self.absolute:
            refused += ["results", "tmp/x", "./x"]
        return refused


def _is_not_software(path: str) -> bool:
    return path == "/" or _under(path, NOT_SOFTWARE[1:])


def _writable(path: Path) -> bool:
    """Whether this process may make or write `path`: its nearest existing ancestor is a
    folder it may write and enter (the path itself, where it exists)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate.is_dir() and os.access(candidate, os.W_OK | os.X_OK)
    return False


@dataclass(frozen=True)
class IntList(Rule):
    """'1,2,4', '[1, 2, 4]', 4 or [1, 2, 4] -> [1, 2, 4]: 1 to max_items distinct integers,
    each what `item` allows, ascending."""
    item: Integer
    max_items: int
    example: str
    kind = "list of integers"

    @property
    def allowed(self) -> str:
        return (f"a list of 1 to {self.max_items} distinct integers >= {self.item.low} and "
                f"<= {self.item.high}, comma-separated, e.g. '{self.example}'")

    def __call__(self, value: Any) -> list[int]:
        if isinstance(value, str):
            if len(value) > self.max_items * 22:  # 19 digits, ', ' and brackets each
                raise ValueError
            text = value[1:-1] if value[:1] == "[" and value[-1:] == "]" else value
            items: list[Any] = [x.strip(" ") for x in text.split(",")]
        elif isinstance(value, (list, tuple)):
            items = list(value)
            if any(not isinstance(x, int) or isinstance(x, bool) for x in items):
                raise ValueError  # an item of a list is its own type: 4, never '4'
        elif isinstance(value, int) and not isinstance(value, bool):
            items = [value]  # papermill's `-p concurrency 4`
        else:
            raise ValueError
        if not 1 <= len(items) <= self.max_items:
            raise ValueError
        values = [self.item(x) for x in items]
        if len(set(values)) != len(values):
            raise ValueError
        return sorted(values)

    def edges(self) -> list[Any]:
        low, high = self.item.low, self.item.high
        longest = list(range(high - self.max_items + 1, high + 1))
        return [[low], [high], low, str(high), f"{low},{high}", f"[{low}, {high}]", longest,
                ",".join(map(str, longest))]

    def beyond(self) -> list[Any]:
        low, high = self.item.low, self.item.high
        too_many = list(range(low, low + self.max_items + 1))
        return [[], [low - 1], [high + 1], [10 ** 9], f"{low},{high + 1}", f"[{10 ** 9}]",
                [str(low)], [float(low)], [True], [None], [[low]], [{}], [low, str(high)],
                [low, low], f"{low},{low}", too_many, ",".join(map(str, too_many)),
                f"{low},,{high}", f"{low},", f"{low} {high}", f"{low};{high}", "[]", "[,]",
                list(range(10_000)), True, 1.5, math.nan]


@dataclass(frozen=True)
class ChoiceList(Rule):
    """'' -> []; 'a,b' or [a, b] -> [a, b]: at_least or more distinct options, order kept."""
    options: tuple[str, ...]
    at_least: int
    described: str
    kind = "list of choices"
    empty_ok = True

    @property
    def allowed(self) -> str:
        return self.described

    def __call__(self, value: Any) -> list[str]:
        if isinstance(value, str):
            if len(value) > sum(len(o) + 2 for o in self.options):
                raise ValueError
            items: list[Any] = [x.strip(" ") for x in value.split(",")] if value else []
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            raise ValueError
        if not items:
            return []
        if len(items) < self.at_least or any(not isinstance(x, str) or x not in self.options
                                             for x in items) or len(set(items)) != len(items):
            raise ValueError
        return items

    def edges(self) -> list[Any]:
        return ["", [], list(self.options[:self.at_least]), ",".join(self.options),
                list(reversed(self.options))]

    def beyond(self) -> list[Any]:
        first = self.options[0]
        return [[first], first, [first, first], f"{first},{first}", [first, "naive"],
                [first, None], [first, 1], [1, 2], f"{first},", ",", [[first]],
                [*self.options, first], True, 1]


@dataclass(frozen=True)
class OrEmpty(Rule):
    """'' (its `meaning`: not given, or none) or what `rule` allows."""
    rule: Rule
    meaning: str
    empty_ok = True

    @property
    def kind(self) -> str:  # type: ignore[override]
        return self.rule.kind

    @property
    def allowed(self) -> str:
        return f"'' ({self.meaning}) or {self.rule.allowed}"

    def __call__(self, value: Any) -> Any:
        return "" if isinstance(value, str) and value == "" else self.rule(value)

    def edges(self) -> list[Any]:
        return ["", *self.rule.edges()]

    def beyond(self) -> list[Any]:
        return [v for v in self.rule.beyond() if v != ""]


# ---- the parameter and its check ---------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    name: str
    rule: Rule
    defaults: dict[str, Any]  # per context; key "*" for every context
    help: str
    # a rule across parameters (lib.stages.registry checks it), said beside the rule's own words
    together: str = ""

    @property
    def allowed(self) -> str:
        """Said to a person when the value is refused, and in the bounds table."""
        return self.rule.allowed + (f" ({self.together})" if self.together else "")

    def default(self, context: str, engine: str = "") -> Any:
        """The default for `context`; a key "<context>:<engine>" wins for that engine (the vLLM
        serve on two GPUs sweeps the cluster's concurrency levels, not the CPU's), then a key
        "*:<engine>" (every context: the pin set an engine is pinned by)."""
        if engine and f"{context}:{engine}" in self.defaults:
            return self.defaults[f"{context}:{engine}"]
        if engine and f"*:{engine}" in self.defaults:
            return self.defaults[f"*:{engine}"]
        return self.defaults.get(context, self.defaults.get("*"))


def checked(param: Param, value: Any) -> Any:
    """The normalised value, or ParameterError naming the parameter and what it allows."""
    try:
        return param.rule(value)
    except (ValueError, TypeError, OverflowError):
        raise ParameterError(param.name, value, param.allowed) from None


# ---- rules of names, shared by the table and the manifests' own checks ---------------------------
def dns_label(what: str) -> Text:
    return Text(DNS1123_LABEL, f"{what} (DNS-1123 label: lower-case letters, digits, '-', at most "
                               "63, starting and ending with a letter or digit)", 63,
                ("a", "deepep-repro", "a" * 63),
                ("a" * 64, "-a", "a-", "A", "Deepep", "a_b", "a.b", "a b", "ａ"))


RUN_ID = Text(RUN_ID_RULE,
              "letters, digits, '.', '_', '-' (1-64 chars, starting with a letter or digit, "
              "no '..')", 64, ("a", "gpu-2xh200-20261130b", "a" * 64),
              ("a" * 65, "a..b", "..", ".a", "-a", "_a", "a/b", "a b", "a\\b"))
KUBE_CONTEXT = Text(KUBE_CONTEXT_RULE, "a kubectl context name (letters, digits, '.', '_', ':', "
                    "'/', '@', '-', at most 253, starting with a letter or digit, no '..')", 253,
                    ("a", "arn:aws:eks:us-west-2:123456789012:cluster/my-eks", "a" * 253),
                    ("a" * 254, "-a", ":a", "/a", "a b", "a;b", "a$b", "a'b", "a\"b"))
IMAGE = Text(IMAGE_RULE, "an image by digest (repo@sha256:<64 hex>) or by a tag that is not a "
             "moving one (" + ", ".join(MOVING_TAGS) + f"), at most {IMAGE_MAX_CHARS} characters",
             IMAGE_MAX_CHARS,
             ("a:1", "a@sha256:" + "0" * 64, "localhost:5000/guide:v1",
              "123456789012.dkr.ecr.us-west-2.amazonaws.com/deepep-v2-efa:pins-0123456789ab",
              "/".join(["a" * 127, "b" * 127]) + ":" + "t" * 128 + "@sha256:" + "f" * 64),
             ("a", "registry.example/guide", "localhost:5000/guide", "a:latest", "a:main",
              "a:nightly", "a:stable", "a:latest@sha256:" + "0" * 64, "a@sha256:" + "0" * 63,
              "a@sha256:" + "G" * 64, "a@md5:" + "0" * 32, "A/b:1", "a:", "a:-x", ":1",
              "a:" + "t" * 129, "a/" * 200 + "a:1", "a..b:1"))
MODEL_ID = Text(MODEL_ID_RULE, "an org/name model id (each 1-96 letters, digits, '_', '.', '-', "
                "starting with a letter or digit, no '--' or '..')", 96 + 1 + 96,
                ("a/b", "Qwen/Qwen3-30B-A3B-FP8", "a" * 96 + "/" + "b" * 96),
                ("a", "a/b/c", "/a", "a/", "a" * 97 + "/b", "a/" + "b" * 97, "a/..", "a/b..c",
                 "a/b--c", "a/-b", "a/b.", "a b/c", "a/b@main"))
COMMIT = Text(COMMIT_RULE, "a commit (40 lower-case hex digits)", 40,
              ("0" * 40, "d206ba732169f29bb77fbf80fc2c4b81d4d30782"),
              ("0" * 39, "0" * 41, "G" * 40, "D206BA732169F29BB77FBF80FC2C4B81D4D30782", "main",
               "v1.0"))
SLURM_NAME = Text(SLURM_NAME_RULE, "a Slurm name (letters, digits, '_', '.', '-', at most 64, "
                  "starting with a letter or digit)", 64, ("a", "gpu", "a" * 64),
                  ("a" * 65, "-a", ".a", "a b", "a,b", "a:b", "a=b"))
