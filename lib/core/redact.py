"""Secret redaction: applied to everything before it is written or returned by the door.

Two nets, because either alone leaks:
- by name: the value of any environment variable whose name looks secret (TOKEN, SECRET, KEY,
  PASSWORD, ...) is replaced wherever it appears, in argv, env, stdout, stderr and files;
- by shape: known token formats (Hugging Face ``hf_...``, AWS access key ids and STS session
  tokens, GitHub tokens, ``Bearer ...`` headers, the password of ``scheme://user:PASSWORD@host``,
  ``--token VALUE`` style arguments) are replaced even when no variable announced them.
The door adds a third: a value a call itself names secret (a secret-named variable of its env, the
value after a secret flag of its argv, a URL's password, an Authorization header) is masked in
everything that call and the later calls of its stage print (`secrets_in_env`,
`secrets_in_argv`, `secrets_in_headers`).
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping

SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|(^|_)KEY($|_)|APIKEY|API_KEY|CREDENTIAL|AUTH", re.I)
# Names that match the pattern but carry no secret and that evidence needs to show.
NOT_SECRET_NAMES = frozenset({"KUBECONFIG", "SSH_AUTH_SOCK", "PYTHONHASHSEED"})

TOKEN_SHAPES = [
    re.compile(r"hf_[A-Za-z0-9]{10,}"),
    re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}\b"),
    re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}\b"),
    re.compile(r"(?i)(?<=bearer )[A-Za-z0-9._~+/=-]{8,}"),
    re.compile(r"(?i)(?<=aws_secret_access_key=)\S+"),
    re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),  # JWT
    # An STS session token (AWS_SESSION_TOKEN, `aws sts`'s SessionToken): base64 of a protobuf
    # whose first bytes are fixed, so it starts the same wherever it is printed.
    re.compile(r"\b(?:IQoJb3JpZ2luX2Vj|FwoGZXIvYXdzE|FQoGZXIvYXdzE)[A-Za-z0-9/+=]{16,}"),
]
# scheme://user:PASSWORD@host: the password goes, the user and host stay (a mirror's or a
# proxy's URL is evidence; `git@github.com:` and `ssh://git@host` carry no password).
URL_PASSWORD = re.compile(r"(?<=://)([^\s/:@\"'<>\\]*):(?!\[REDACTED\])([^\s/@\"'<>\\]+)@")
# The value after a secret-named flag (`--hf-token X`, `--api-key=X`) or key (`HF_TOKEN=X`,
# `"access_token": "X"`, `password: X`). The name must END with the secret word, so
# `num_tokens=128`, `max_new_tokens`, `--tokenizer` or `--use-server-token-count` are left alone.
# One list, used both by SECRET_FLAG (flags inside text) and by redact_argv (argv elements).
_SECRET_WORDS = ("token", "secret", "password", "passwd", "passphrase", "api[-_]?key",
                 "access[-_]?key", "secret[-_]?key", "credentials?", "auth")
_SECRET_WORD = rf"[\w-]*(?:{'|'.join(_SECRET_WORDS)})"
# A whole flag name (dashes stripped) that is secret: `token`, `hf-token`, `aws_secret_access_key`.
SECRET_FLAG_NAME = re.compile(rf"(?i){_SECRET_WORD}")
# Keys are narrower than flags: data is full of keys like "time_to_first_token".
_SECRET_KEY_NAME = (r"(?:[\w-]*(?:secret|password|passwd|api[-_]?key|secret[-_]?access[-_]?key)"
                    r"|token|[\w-]*(?:access|auth|"
                    r"hf|refresh|session|id|bearer|api|github|gh|aws)[-_]?token)")
# A value worth masking: not an object or list, not a number, boolean or null.
_SECRET_VALUE = r"(?!\[REDACTED)(?![{\[])(?!(?:-?\d+(?:\.\d+)?|true|false|null|none)\b)([^\s\"',}]+)"
SECRET_FLAG = re.compile(rf"(?i)(?<![\w-])(--?{_SECRET_WORD})(=|\s+){_SECRET_VALUE}")
SECRET_KEY = re.compile(
    rf"(?i)(?<![\w-])([\"']?{_SECRET_KEY_NAME}[\"']?\s*(?:=|:)\s*[\"']?){_SECRET_VALUE}")
MASK = "[REDACTED]"
MIN_SECRET_LEN = 6  # shorter values ("1", "yes") would shred unrelated text


def is_secret_name(name: str) -> bool:
    return name not in NOT_SECRET_NAMES and bool(SECRET_NAME.search(name))


def is_secret_flag(arg: str) -> bool:
    """`--hf-token`, `--api-key`, `--aws-secret-access-key`: a flag whose name ENDS with a secret
    word (case-insensitive, `-` and `_` alike). `--num-tokens`, `--tokenizer`, `--max-tokens`,
    `--use-server-token-count` or `--keyfile` are not: their values are evidence."""
    return (arg.startswith("-") and "=" not in arg
            and bool(SECRET_FLAG_NAME.fullmatch(arg.lstrip("-"))))


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of secret-named variables, longest first so overlapping values mask fully."""
    environ = os.environ if environ is None else environ
    values = {v for k, v in environ.items() if is_secret_name(k) and len(v) >= MIN_SECRET_LEN}
    return sorted(values, key=len, reverse=True)


def redact(text: str, extra_values: list[str] | None = None) -> str:
    if not text:
        return text
    for value in secret_values() + list(extra_values or []):
        if value and len(value) >= MIN_SECRET_LEN:
            text = text.replace(value, MASK)
    for shape in TOKEN_SHAPES:
        text = shape.sub(MASK, text)
    if "://" in text:
        text = URL_PASSWORD.sub(lambda m: m.group(1) + ":" + MASK + "@", text)
    text = SECRET_FLAG.sub(lambda m: m.group(1) + m.group(2) + MASK, text)
    return SECRET_KEY.sub(lambda m: m.group(1) + MASK, text)


def redact_argv(argv: list[str], extra_values: list[str] | None = None) -> list[str]:
    """Every element through redact(); besides, the element after a secret flag is masked whole
    (`--hf-token X`). A next element that is itself a long flag (`--no-auth --port 8000`) is a
    flag, not the value, and is kept. `--flag=value` forms are handled by redact()'s SECRET_FLAG."""
    out: list[str] = []
    mask_next = False
    for arg in argv:
        if mask_next and not arg.startswith("--"):
            out.append(MASK)
            mask_next = False
            continue
        mask_next = is_secret_flag(arg)
        out.append(redact(arg, extra_values))
    return out


def redact_env(env: Mapping[str, str], extra_values: list[str] | None = None) -> dict[str, str]:
    return {k: (MASK if is_secret_name(k) else redact(v, extra_values)) for k, v in env.items()}


# ---- what a call itself says is secret (the door masks it in what the call prints) ------------
_BEARER_VALUE = re.compile(r"(?i)\bbearer\s+(\S+)")


def _inner(value: str) -> list[str]:
    """The secrets inside a value: a URL's password, a `Bearer` header's token."""
    parts = [m.group(2) for m in URL_PASSWORD.finditer(value)]
    parts += [m.group(1) for m in _BEARER_VALUE.finditer(value) if _generated(m.group(1))]
    return [p for p in parts if len(p) >= MIN_SECRET_LEN and p != MASK]


def _generated(word: str) -> bool:
    """A token, not a word (`bearer authentication` names no secret): a digit or mixed case."""
    return len(word) >= 8 and (any(c.isdigit() for c in word) or (
        any(c.isupper() for c in word) and any(c.islower() for c in word)))


def _whole(value: str) -> list[str]:
    """A secret value and the secrets inside it."""
    return ([value] if len(value) >= MIN_SECRET_LEN and value != MASK else []) + _inner(value)


def secrets_in_env(env: Mapping[str, str] | None) -> list[str]:
    """Values a call's env names secret (by the variable's name), and the passwords of URLs in
    any of its values (`HTTPS_PROXY=http://user:PASS@proxy:3128`)."""
    found: list[str] = []
    for name, value in (env or {}).items():
        value = str(value)
        found += _whole(value) if is_secret_name(name) else _inner(value)
    return found


def secrets_in_argv(argv: list[str]) -> list[str]:
    """Values an argv names secret: after a secret flag (`--aws-secret-access-key X`,
    `--api-key=X`), a URL's password, a `Bearer` token."""
    found: list[str] = []
    take_next = False
    for arg in (str(a) for a in argv):
        if take_next and not arg.startswith("--"):
            found += _whole(arg)
        take_next = is_secret_flag(arg)
        name, eq, value = arg.partition("=")
        if eq and name.startswith("-") and SECRET_FLAG_NAME.fullmatch(name.lstrip("-")):
            found += _whole(value)
        found += _inner(arg)
    return found


def secrets_in_headers(headers: Mapping[str, str] | None) -> list[str]:
    """Values of request headers that carry credentials (Authorization, Cookie, X-Api-Key, ...)."""
    found: list[str] = []
    for name, value in (headers or {}).items():
        if name.lower() in ("authorization", "proxy-authorization", "cookie") or is_secret_name(
                name.replace("-", "_")):
            found += _whole(str(value))
    return found
