"""Refuse to publish identities: a scan of everything the book would publish.

The door masks secrets before they are written (lib/core/redact.py), but evidence also holds
what is no secret to a process and still must not reach a public page: a cluster's private
addresses and host names, the AWS account that owns it, a home directory's user name, and any
token that slipped past the door. The book publishes every file under _build/html (pages,
_sources/, _static/, _images/, downloads), so the scan reads every text file there, text decided
by content (an image's signature or a NUL byte makes a file binary: images, fonts, compiled
catalogues), and names each identity found by path, line and kind, masked so that the refusal
republishes nothing.

Every shape is narrow on purpose: a refusal that fires on a version string or a timestamp gets
switched off. An IPv4 address counts only standing alone (not inside 10.1.2.3.4), a 12-digit
number is an account id only where an ARN, an ECR host or an account key says so, a secret
value only where its name stands next to it, and a bearer token only when it looks generated.
"""
from __future__ import annotations

import html
import ipaddress
import re
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lib.core import redact
from lib.core.identities import NOT_ADDRESSES
from lib.core.errors import REFUSAL_LINES, PublishRefused  # noqa: F401  raised here

# Kinds, as printed in a refusal (one word each, so `path:line kind masked` splits on spaces).
PRIVATE_IPV4 = "private-ipv4"
EC2_HOST = "ec2-private-host"
AWS_ACCOUNT_ID = "aws-account-id"
HF_TOKEN = "hf-token"
AWS_ACCESS_KEY_ID = "aws-access-key-id"
AWS_SECRET_ACCESS_KEY = "aws-secret-access-key"
AWS_SESSION_TOKEN = "aws-session-token"
GITHUB_TOKEN = "github-token"
BEARER_TOKEN = "bearer-token"
JWT = "jwt"
URL_PASSWORD = "url-password"
PERSONAL_PATH = "personal-path"

PRIVATE_NETWORKS = tuple(ipaddress.IPv4Network(net) for net in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
    "100.64.0.0/10",  # carrier-grade NAT: EKS pods and VPC peering hand these out
))
# Windows and macOS home folders that belong to no one.
SHARED_HOMES = frozenset({"Shared", "Public", "Default", "All Users", "Default User"})
_MASK_KEEP = 4  # characters of a value a finding shows, at most a third of the value


@dataclass(frozen=True)
class Finding:
    path: str  # relative to the scanned root, with forward slashes
    line: int  # 1-based
    kind: str
    masked: str  # the first characters of the value, then `...`: never the whole value

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.kind} {self.masked}"


@dataclass(frozen=True)
class Shape:
    """A kind of identity. The pattern's `value` group (or the whole match) is the identity.
    The pattern starts with a literal where it can, since Python's re skips fast only to a
    literal; so what a leading lookbehind would say is `not_after` (a character class the
    character before the match must not be in), `hints` are strings one of which every match
    contains (lowercase for a case-blind pattern; a text holding none is not searched), and
    `plausible` rejects what a pattern cannot (an octet over 255, a placeholder)."""
    kind: str
    pattern: re.Pattern
    not_after: re.Pattern | None = None
    hints: tuple[str, ...] = ()
    plausible: Callable[[re.Match], bool] = lambda match: True


def _value(match: re.Match) -> str:
    return match.group("value") if "value" in match.re.groupindex else match.group()


def _redact_shape(example: str) -> re.Pattern:
    """The pattern of redact.TOKEN_SHAPES that finds `example`, so the door's redaction and this
    scan share one definition of a token's shape; a shape changed there fails here, at import."""
    shapes = [shape for shape in redact.TOKEN_SHAPES if shape.fullmatch(example)]
    if len(shapes) != 1:
        raise ImportError(f"lib.core.redact.TOKEN_SHAPES: {len(shapes)} shapes find the "
                          f"{example[:4]}... example, expected exactly one")
    return shapes[0]


_NUMBERS_BEFORE = re.compile(r"(?<![\d.])([\d.]+)[\s,-]+\Z")
_NUMBERS_AFTER = re.compile(r"[\s,-]+([\d.]+)")
_IPV4_SHAPE = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}")


def _is_decimals(run: re.Match | None) -> bool:
    """Digits and dots that are decimals, not an address: `13.47`, or SVG's `1.17.81`."""
    return run is not None and "." in run.group(1) and not _IPV4_SHAPE.fullmatch(run.group(1))


def _is_private_ipv4(match: re.Match) -> bool:
    """A private address, unless it sits between decimals: SVG path data (the theme's icons in
    _static/scripts/fontawesome.js) writes `-13.47 10.1.9.34 1.17.81` for the numbers -13.47,
    10.1, .9, .34, 1.17 and .81. A list of addresses keeps each one: its neighbours are
    addresses, not decimals."""
    try:
        address = ipaddress.IPv4Address(match.group())
    except ValueError:  # an octet over 255, or a leading zero: not an address
        return False
    if not any(address in network for network in PRIVATE_NETWORKS):
        return False
    if match.group() in NOT_ADDRESSES:  # a pinned version (lib.core.identities)
        return False
    text, start, end = match.string, match.start(), match.end()
    return not (_is_decimals(_NUMBERS_BEFORE.search(text, max(0, start - 32), start))
                and _is_decimals(_NUMBERS_AFTER.match(text, end, end + 32)))


def _is_ipv4_in_host_name(match: re.Match) -> bool:
    """`ip-10-1-2-3...` names a VPC address, so its four numbers must make one."""
    octets = re.match(r"ip-(\d+)-(\d+)-(\d+)-(\d+)", match.group())
    return octets is None or all(int(octet) <= 255 for octet in octets.groups())


def _looks_generated(match: re.Match) -> bool:
    """A token, not a word: `Bearer 9f8e...` or `Bearer eyJh...`, never `bearer authentication`."""
    value = _value(match)
    return any(c.isdigit() for c in value) or (
        any(c.isupper() for c in value[1:]) and any(c.islower() for c in value))


def _is_a_value(match: re.Match) -> bool:
    """Not a placeholder (`$PASS`, `${TOKEN}`, `%PASS%`, `****`) nor the door's own mask: those
    show where a secret goes, not the secret."""
    value = _value(match)
    return value != redact.MASK and value[0] not in "$%{" and set(value) != {"*"}


def _is_personal_home(match: re.Match) -> bool:
    user = re.split(r"[/\\]+", _value(match).rstrip("/\\"))[-1]
    return user not in SHARED_HOMES


# Between a name and its value: quotes (JSON-escaped inside a notebook too) and spaces around
# one `:` or `=`, or at least a space or a quote, so `SessionTokenProvider` is a name, no value.
# HTML-escaped quotes are unescaped before matching (see _views).
_NEXT_TO = r"""(?:[\s"'`\\]*[:=][\s"'`\\]*|[\s"'`\\]+)"""
_WORD_OR_DOT = re.compile(r"[\w.]")
_WORD_OR_DASH = re.compile(r"[\w-]")
_WORD_DOT_OR_DASH = re.compile(r"[\w.-]")

SHAPES = [
    # Standing alone: not after a word character or a dot, not before one or a further `.digit`;
    # so 10.1.2.3.4 (a version), v10.1.2.3 and 1.10.1.2.3 are no address, `at 10.1.2.3.` is.
    Shape(PRIVATE_IPV4, re.compile(r"(?:10|172|192|100)\.\d{1,3}\.\d{1,3}\.\d{1,3}(?!\w|\.\d)"),
          not_after=_WORD_OR_DOT, plausible=_is_private_ipv4),
    # EC2 names a host for its private address (ip-10-1-2-3[.region].compute.internal or
    # .ec2.internal) or, with resource-based naming, for its instance id.
    Shape(EC2_HOST, re.compile(
        r"ip(?:-\d{1,3}){4}(?:(?:\.[a-z0-9-]+)?\.(?:ec2|compute)\.internal)?(?![\w-]|\.\d)"
        r"|i-[0-9a-f]{8,17}(?:\.[a-z0-9-]+)?\.(?:ec2|compute)\.internal(?![\w-])"),
          not_after=_WORD_OR_DASH, hints=("ip-", ".internal"), plausible=_is_ipv4_in_host_name),
    # A bare 12-digit number is a counter or a timestamp; it is an account id only in an ARN
    # (arn:partition:service:region:ACCOUNT:resource), an ECR registry host, or after a key that
    # says account (account, Account, account_id, aws_account_id, AWS_ACCOUNT_ID).
    Shape(AWS_ACCOUNT_ID, re.compile(r"arn:aws[\w-]*:[\w-]*:[\w-]*:(?P<value>\d{12}):")),
    Shape(AWS_ACCOUNT_ID, re.compile(
        r"(?P<value>\d{12})\.dkr\.ecr(?:-fips)?\.[a-z0-9-]+\.amazonaws\.com"),
          not_after=_WORD_DOT_OR_DASH, hints=(".dkr.ecr",)),
    Shape(AWS_ACCOUNT_ID, re.compile(
        rf"(?i)account(?:[_ -]?id)?{_NEXT_TO}(?P<value>\d{{12}})(?!\d)"),
          hints=("account",)),
    # Hugging Face tokens are hf_ and 34 letters or digits; redact.py masks from 10 on, which in
    # prose would catch identifiers, so the scan asks for 30.
    Shape(HF_TOKEN, re.compile(r"hf_[A-Za-z0-9]{30,}")),
    Shape(AWS_ACCESS_KEY_ID, _redact_shape("AKIA" + "IOSFODNN7EXAMPLE"), hints=("AKIA", "ASIA")),
    # 40 characters of base64 next to a name ending in secret key: secret_key,
    # aws_secret_access_key, AWS_SECRET_ACCESS_KEY, SecretAccessKey (what `aws sts` prints).
    Shape(AWS_SECRET_ACCESS_KEY, re.compile(
        rf"(?i)secret[_-]?(?:access[_-]?)?key{_NEXT_TO}"
        r"(?P<value>[A-Za-z0-9/+]{40})(?![A-Za-z0-9/+=])"), hints=("secret",)),
    # aws_session_token, AWS_SESSION_TOKEN, SessionToken (what `aws sts` prints).
    Shape(AWS_SESSION_TOKEN, re.compile(
        rf"(?i)session[_-]?token{_NEXT_TO}(?P<value>[A-Za-z0-9/+=]{{16,}})"), hints=("session",)),
    Shape(GITHUB_TOKEN, _redact_shape("ghp_" + "0" * 36),
          hints=("ghp_", "gho_", "ghu_", "ghs_", "ghr_")),
    Shape(GITHUB_TOKEN, _redact_shape("github_pat_" + "0" * 22), hints=("github_pat_",)),
    Shape(BEARER_TOKEN, re.compile(r"(?i)bearer\s+(?P<value>[A-Za-z0-9._~+/-]{16,}=*)"),
          hints=("bearer",), plausible=_looks_generated),
    Shape(JWT, _redact_shape("eyJ" + "0" * 8 + "." + "0" * 8 + "." + "0" * 8), hints=("eyJ",)),
    # scheme://user:PASSWORD@host; `git@github.com:` and `ssh://git@host` carry no password.
    Shape(URL_PASSWORD, re.compile(r"://[^\s/:@\"'<>\\]+:(?P<value>[^\s/@\"'<>\\]+)@[\w.\[-]"),
          plausible=_is_a_value),
    # /home/USER/ and /Users/USER/: not after a word or a dot, so a URL's /home/page/ is no
    # home; /home/ alone names no one.
    Shape(PERSONAL_PATH, re.compile(r"/(?:home|Users)/[A-Za-z0-9_][\w.-]*/"),
          not_after=_WORD_DOT_OR_DASH, hints=("/home/", "/Users/"), plausible=_is_personal_home),
    # C:\Users\USER\, its backslashes doubled inside JSON.
    Shape(PERSONAL_PATH, re.compile(
        r"[A-Za-z]:\\{1,2}Users\\{1,2}[A-Za-z0-9_][^\\/:*?\"<>|\r\n]*\\"),
          hints=("\\Users\\",), plausible=_is_personal_home),
]

_TAG = re.compile(r"<[^<>\n]*>")


def mask(value: str) -> str:
    """The first characters of `value` (at most a third of it), then `...`."""
    return value[:min(_MASK_KEEP, len(value) // 3)] + "..."


def is_image(data: bytes) -> bool:
    """PNG, JPEG, GIF or WebP by their first bytes: binary even where no NUL byte shows."""
    return (data.startswith((b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a"))
            or data[:4] == b"RIFF" and data[8:12] == b"WEBP")


def read_text(path: Path) -> str | None:
    """The file's text, or None when its content is binary: an image, or a NUL byte anywhere
    (fonts, compiled message catalogues, compressed files)."""
    data = path.read_bytes()
    if b"\0" in data or is_image(data):
        return None
    return data.decode("utf-8", errors="replace")


def _views(text: str) -> list[str]:
    """The text as stored, and, where it holds markup, as a reader sees it (tags dropped,
    entities unescaped, line for line): a highlighted code cell splits `KEY=value` into spans
    and a notebook's HTML output writes `&quot;`, and each would hide a value from its name."""
    if "<" not in text and "&" not in text:
        return [text]
    rendered = "\n".join(html.unescape(_TAG.sub("", line)).replace("\n", " ")
                         for line in text.split("\n"))
    return [text, rendered]


def find_in_text(text: str, path: str = "") -> list[Finding]:
    """Every identity in `text`, once per line, kind and value."""
    seen: set[tuple[int, str, str]] = set()
    findings = []
    for view in _views(text):
        lowered = view.lower()
        line_starts: list[int] = []  # counted at the first match: most files have none
        for shape in SHAPES:
            searched = lowered if shape.pattern.flags & re.IGNORECASE else view
            if shape.hints and not any(hint in searched for hint in shape.hints):
                continue
            for match in shape.pattern.finditer(view):
                before = view[match.start() - 1:match.start()]
                if shape.not_after and shape.not_after.match(before) or not shape.plausible(match):
                    continue
                value = _value(match)
                line_starts = line_starts or [0] + [m.end() for m in re.finditer("\n", view)]
                line = bisect_right(line_starts, match.start())
                if (line, shape.kind, value) not in seen:
                    seen.add((line, shape.kind, value))
                    findings.append(Finding(path, line, shape.kind, mask(value)))
    return sorted(findings, key=lambda f: (f.line, f.kind, f.masked))


def find_identities(root: Path) -> list[Finding]:
    """Every identity in every text file under `root`, in path order."""
    root = Path(root)
    findings = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        text = read_text(path)
        if text is not None:
            findings += find_in_text(text, path.relative_to(root).as_posix())
    return findings


def refuse_identities(root: Path) -> None:
    """Raise PublishRefused, listing each identity, unless `root` holds none."""
    findings = find_identities(root)
    if findings:
        raise PublishRefused(root, findings)
