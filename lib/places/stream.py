"""Files brought back from a cluster through a process's log.

A finished Kubernetes Job's pod cannot be copied from (`kubectl cp` needs a running container),
and a Slurm step's node may not share a file system with the run. So a one-shot job that makes
files (AIPerf's artifacts) ends by printing them into its own log, between two marker lines:

    === guide-artifacts begin NAME ===
    <the folder as a gzipped tar, base64, 76 columns>
    === guide-artifacts end NAME sha256=<hex of the tar.gz> ===

`pack_command(folder, name)` is the shell line a job runs to print them (POSIX sh, tar, base64,
sha256sum: in every image the guide runs); `unpack(log_text, name, dest)` finds the block in the
log it got back (through `kubectl logs`, or a step's output file), checks the digest, and
extracts the files into `dest` (the stage's folder), refusing any path that would leave it.
"""
from __future__ import annotations

import base64
import hashlib
import io
import re
import shlex
import tarfile
from pathlib import Path

from lib.core.errors import StreamError  # its home; lib.places.stream.StreamError too

BEGIN = "=== guide-artifacts begin {name} ==="
END = "=== guide-artifacts end {name} sha256={digest} ==="
NAME_RULE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def pack_command(folder: str, name: str) -> str:
    """The POSIX sh line that prints `folder` as a block named `name` (after the job's work)."""
    _check_name(name)
    q = shlex.quote(folder)
    return (f"tar -czf /tmp/{name}.tgz -C {q} . && echo {shlex.quote(BEGIN.format(name=name))}"
            f" && base64 -w 76 /tmp/{name}.tgz && echo \"=== guide-artifacts end {name} "
            f"sha256=$(sha256sum /tmp/{name}.tgz | cut -d' ' -f1) ===\"")


def pack(folder: Path, name: str) -> str:
    """What pack_command prints, made here (tests compose a job's log with it)."""
    _check_name(name)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(Path(folder).rglob("*")):
            tar.add(path, arcname="./" + path.relative_to(folder).as_posix(), recursive=False)
    data = buffer.getvalue()
    encoded = base64.encodebytes(data).decode().replace("\n", "")
    lines = [encoded[i:i + 76] for i in range(0, len(encoded), 76)]
    return "\n".join([BEGIN.format(name=name), *lines,
                      END.format(name=name, digest=hashlib.sha256(data).hexdigest())]) + "\n"


def unpack(log_text: str, name: str, dest: Path) -> list[Path]:
    """Extract the block `name` of the log into `dest`; the files extracted, in order."""
    _check_name(name)
    begin = BEGIN.format(name=name)
    end = re.compile(rf"^=== guide-artifacts end {re.escape(name)} sha256=([0-9a-f]{{64}}) ===$")
    lines = log_text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == begin)
    except StopIteration:
        raise StreamError(f"no '{begin}' line in the log: the job did not print its files "
                          "(it failed before, or its log was cut)") from None
    for stop in range(start + 1, len(lines)):
        found = end.match(lines[stop].strip())
        if found:
            break
    else:
        raise StreamError(f"the block {name!r} has no end line: the log was cut")
    data = base64.b64decode("".join(line.strip() for line in lines[start + 1:stop]))
    digest = hashlib.sha256(data).hexdigest()
    if digest != found.group(1):
        raise StreamError(f"the block {name!r} is damaged: sha256 {digest}, the job printed "
                          f"{found.group(1)}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    root = dest.resolve()
    extracted = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            target = (dest / member.name).resolve()
            if root not in (target, *target.parents) or member.issym() or member.islnk():
                raise StreamError(f"the block {name!r} holds {member.name!r}, which would "
                                  f"leave {dest}")
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
            elif member.isfile():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
                extracted.append(target)
    return extracted


def _check_name(name: str) -> None:
    if not NAME_RULE.match(name or ""):
        raise StreamError(f"block name {name!r}: letters, digits, '.', '_', '-'")
