"""Secret redaction: applied to everything before it is written or returned by the door.

Two nets, because either alone leaks:
- by name: the value of any environment variable whose name looks secret (TOKEN, SECRET, KEY,
  PASSWORD, ...) is replaced wherever it appears, in argv, env, stdout, stderr and files;
- by shape: known token formats (Hugging Face ``hf_...``, AWS access key ids, GitHub tokens,
  ``Bearer ...`` headers, ``--token VALUE`` style arguments) are replaced even when no variable
  announced them.
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
]
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
_SECRET_KEY_NAME = (r"(?:[\w-]*(?:secret|password|passwd|api[-_]?key)|token|[\w-]*(?:access|auth|"
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
    text = SECRET_FLAG.sub(lambda m: m.group(1) + m.group(2) + MASK, text)
    return SECRET_KEY.sub(lambda m: m.group(1) + MASK, text)


def redact_argv(argv: list[str]) -> list[str]:
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
        out.append(redact(arg))
    return out


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: (MASK if is_secret_name(k) else redact(v)) for k, v in env.items()}
