"""This project's own patches to an installed package, applied to a site folder and recorded there.

A site folder is what ``pip install --no-deps --target SITE`` makes (scripts/vllm-site.sh
unpacks vLLM's). The patches are the pins of kind ``patch`` with a ``path`` (patches/*.patch)
whose ``applies_to`` names the package's pypi pin, in their ``order``::

    python3 -m lib.engines.site_patches apply SITE vllm     # on the GPU machine, after unpacking

Before anything changes it checks that each patch file has its pinned sha256 and that SITE holds
the pinned version of the package (its ``<package>-<version>.dist-info``); each patch is tried
with ``patch --dry-run`` first, so a patch that does not apply leaves SITE as it was. What was
applied is written to ``SITE/.guide-patches.json``: the pin, the patch's sha256, and the sha256
of every file it changed. Applying again is a no-op. ``applied_on(PYTHONPATH)`` reads those
records back for a run's run.json, each file checked against its recorded sha256, so a run says
which patched code it ran and whether that code changed after patching. GNU patch runs through
the door, as every process: each call, its output and exit code in ``SITE/.guide-patches.calls/``
(a transcript of its own: the site is patched before any run).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from lib.core.door import CallResult, Door
from lib.core.errors import SitePatchError
from lib.roots import pins as pins_mod

RECORD = ".guide-patches.json"
CALLS = ".guide-patches.calls"  # the door's folder in the site: GNU patch's calls, recorded
PATCH_TIMEOUT_S = 60.0  # one patch of a few files; a patch that waits on a question never ends
REPO_ROOT = Path(__file__).resolve().parents[2]


def pins_of(data: dict | None, pin_set: str | None) -> dict:
    """pins.yaml checked, as the set `pin_set` has it (None: the file's own pins, the base set)."""
    data = pins_mod.check(data if data is not None else pins_mod.load())
    return pins_mod.select(data, pin_set) if pin_set else data


def patch_pins(package_pin: str, data: dict | None = None,
               pin_set: str | None = None) -> list[tuple[str, dict]]:
    """(name, pin) of this project's own patches to the pin `package_pin`, in their order."""
    data = pins_of(data, pin_set)
    if package_pin not in data["pins"]:
        known = sorted(n for n, p in pins_mod.items(data) if p.get("kind") == "pypi")
        raise SitePatchError(f"package pin {package_pin!r} is not in pins.yaml; pypi pins: "
                             f"{', '.join(known)}")
    found = [(name, pin) for name, pin in pins_mod.items(data)
             if pin.get("kind") == "patch" and pin.get("applies_to") == package_pin
             and "path" in pin and pins_mod.status(pin) == "pinned"]
    return sorted(found, key=lambda item: item[1]["order"])


def patched_files(patch_text: str) -> list[str]:
    """The paths a unified diff changes, as `patch -p1` resolves them (from its +++ lines)."""
    files = []
    for line in patch_text.splitlines():
        if line.startswith("+++ "):
            path = line[4:].split("\t")[0].strip()
            files.append(path.split("/", 1)[1] if "/" in path else path)
    return files


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def apply(site: Path, package_pin: str, *, data: dict | None = None,
          repo_root: Path = REPO_ROOT, pin_set: str | None = None) -> dict:
    """Applies the package's patch pins (of the pin set `pin_set`, default the base set) to
    `site`; returns the record written there."""
    site = Path(site)
    data = pins_of(data, pin_set)
    package = data["pins"].get(package_pin, {})
    patches = patch_pins(package_pin, data)
    name, version = package.get("package"), str(package.get("version"))
    dist = site / f"{name}-{version}.dist-info"
    if not dist.is_dir():
        held = sorted(p.name for p in site.glob(f"{name}-*.dist-info")) if site.is_dir() else []
        raise SitePatchError(f"{site}: no {dist.name} (holds {held or 'none'}); the patches of "
                             f"pins.{package_pin} apply to {name} {version} only")
    record_path = site / RECORD
    record = (json.loads(record_path.read_text()) if record_path.exists()
              else {"package": name, "version": version, "patches": []})
    done = {entry["pin"]: entry for entry in record["patches"]}
    door = None  # made at the first patch to run: a site with nothing to do is not touched
    for pin_name, pin in patches:
        patch_file = repo_root / pin["path"]
        got = sha256_file(patch_file) if patch_file.is_file() else None
        if got != pin["sha256"]:
            raise SitePatchError(f"pins.{pin_name}: {pin['path']} has sha256 {got}, pinned "
                                 f"{pin['sha256']}")
        if pin_name in done:
            entry = done[pin_name]
            if entry["sha256"] == got and _unchanged(site, entry["files"]):
                continue
            # Unpacked again over a patched site (its files back to the original), or a
            # different patch file: forget the entry; the dry run below says whether it applies.
            record["patches"].remove(entry)
        files = patched_files(patch_file.read_text())
        door = door or Door(site / CALLS, "site_patches")
        dry = _patch(door, site, patch_file, "--dry-run")
        if dry.rc != 0:
            reverse = _patch(door, site, patch_file, "--dry-run", "--reverse")
            raise SitePatchError(
                f"pins.{pin_name}: {pin['path']} does not apply to {site}"
                + (" (it is already applied there, but not recorded in " + RECORD + ")"
                   if reverse.rc == 0 else "")
                + f":\n{dry.stdout}{dry.stderr}")
        applied = _patch(door, site, patch_file)
        if applied.rc != 0:  # the dry run passed: not expected
            raise SitePatchError(f"pins.{pin_name}: patch failed after its dry run passed:\n"
                                 f"{applied.stdout}{applied.stderr}")
        record["patches"].append({"pin": pin_name, "path": pin["path"], "sha256": got,
                                  "files": {f: sha256_file(site / f) for f in files}})
        # in the patches' order, also when one was applied again (unpacked over its patched self)
        order = {name: n for n, (name, _) in enumerate(patches)}
        record["patches"].sort(key=lambda entry: order.get(entry["pin"], len(order)))
        record_path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def _unchanged(site: Path, files: dict[str, str]) -> bool:
    return all((site / f).is_file() and sha256_file(site / f) == sha for f, sha in files.items())


def _patch(door: Door, site: Path, patch_file: Path, *flags: str) -> CallResult:
    # --forward: never reverse a patch that looks applied; --batch: never ask; no backup files
    done = door.run(["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", *flags,
                     "-d", str(site), "-i", str(patch_file)], timeout=PATCH_TIMEOUT_S,
                    check=False)
    if done.not_found:
        raise SitePatchError(f"GNU patch is needed to apply {patch_file.name}: {done.stderr}")
    if done.timed_out:
        raise SitePatchError(f"patch {patch_file.name} did not end in {PATCH_TIMEOUT_S:.0f} s")
    return done


def applied_on(pythonpath: str | None) -> list[dict]:
    """The patch records of the site folders on `pythonpath`, each file checked again.

    One entry per folder that holds a record: {"site", "package", "version", "patches"}, each
    patch with "unchanged": true when every file it changed still has its recorded sha256.
    """
    found = []
    for entry in (pythonpath or "").split(":"):
        record_path = Path(entry) / RECORD if entry else None
        if record_path is None or not record_path.is_file():
            continue
        record = json.loads(record_path.read_text())
        for patch in record["patches"]:
            patch["unchanged"] = _unchanged(Path(entry), patch["files"])
        found.append({"site": entry, **record})
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m lib.engines.site_patches",
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("apply", help="apply the pinned patches of a package to a site folder")
    cmd.add_argument("site", type=Path)
    cmd.add_argument("package_pin", help="the pypi pin the patches apply to, e.g. vllm")
    cmd.add_argument("--pin-set", default=None,
                     help="the pin set whose package and patches apply (default: the base set)")
    args = parser.parse_args(argv)
    try:
        record = apply(args.site, args.package_pin, pin_set=args.pin_set)
    except SitePatchError as exc:
        print(f"site_patches: {exc}", file=sys.stderr)
        return 1
    for patch in record["patches"]:
        print(f"site_patches: {args.site}: {patch['pin']} applied, as {RECORD} there records "
              f"({patch['path']}, sha256 {patch['sha256'][:12]}...; files "
              f"{', '.join(patch['files'])})")
    if not record["patches"]:
        print(f"site_patches: {args.site}: pins.yaml has no patch for {args.package_pin}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
