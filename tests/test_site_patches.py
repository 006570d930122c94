"""This project's own vLLM patch: pinned, applied by the real GNU patch to a site folder the test
makes, recorded there and in run.json; every refusal leaves the site as it was.

The site's file is rebuilt from the committed patch itself (its context and removed lines, at the
hunk's line number), so the test needs no vLLM and checks the patch file that the GPU machines
apply."""
import json
import re
from pathlib import Path

import pytest

from lib.stages import registry as params
from lib.roots import pins
from lib.engines import site_patches
from lib.core.door import REPO_ROOT, Door, read_transcript
from lib.engines.site_patches import RECORD, SitePatchError

PIN = "vllm_patch_deepep_v2_expert_ids"
PATCH = REPO_ROOT / pins.load()["pins"][PIN]["path"]
# patch 0002 (ElasticBuffer timeouts) follows it; its target is vLLM 0.24.0's own file
TIMEOUTS_PIN = "vllm_patch_deepep_v2_timeouts"
ALL2ALL = "vllm/distributed/device_communicators/all2all.py"
ALL2ALL_0_24 = REPO_ROOT / "tests" / "fixtures" / "vllm-0.24.0" / "all2all.py"


def images(patch_text: str) -> tuple[str, str, str]:
    """(file, before, after) of the patch's one hunk, placed at its line number."""
    (target,) = site_patches.patched_files(patch_text)
    hunk = patch_text[patch_text.index("\n@@ "):]
    start = int(re.search(r"@@ -(\d+)", hunk).group(1))
    before, after = [], []
    for line in hunk.splitlines()[2:]:
        if line.startswith((" ", "-")):
            before.append(line[1:])
        if line.startswith((" ", "+")):
            after.append(line[1:])
    head = [f"# line {n}" for n in range(1, start)]
    tail = ["", "# the rest of the module"]
    return (target, "\n".join(head + before + tail) + "\n",
            "\n".join(head + after + tail) + "\n")


@pytest.fixture
def site(tmp_path):
    target, before, _ = images(PATCH.read_text())
    root = tmp_path / "vllm-site"
    (root / "vllm-0.24.0.dist-info").mkdir(parents=True)
    (root / target).parent.mkdir(parents=True)
    (root / target).write_text(before)
    (root / ALL2ALL).parent.mkdir(parents=True, exist_ok=True)
    (root / ALL2ALL).write_bytes(ALL2ALL_0_24.read_bytes())
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file of the site but the door's record of the patch calls (site_patches.CALLS)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.relative_to(root).parts[0] != site_patches.CALLS}


def patch_calls(site: Path) -> list[dict]:
    """GNU patch's calls, as the door recorded them in the site."""
    return read_transcript(site / site_patches.CALLS / "transcript.jsonl")


def test_the_pinned_patch_applies_once_and_is_recorded(site):
    target, _, after = images(PATCH.read_text())
    record = site_patches.apply(site, "vllm")
    assert (site / target).read_text() == after
    assert "tl.where(valid, g, elsewhere)" in after and "tl.where(valid, g, -1)" not in after
    entry = record["patches"][0]
    assert [p["pin"] for p in record["patches"]] == [PIN, TIMEOUTS_PIN]
    assert entry["pin"] == PIN and entry["sha256"] == pins.load()["pins"][PIN]["sha256"]
    assert entry["files"] == {target: site_patches.sha256_file(site / target)}
    assert json.loads((site / RECORD).read_text()) == record
    assert not [p for p in site.rglob("*") if p.suffix in (".orig", ".rej")]
    # GNU patch through the door: per patch its dry run, then the patch itself, each exit 0
    calls = [(e["key"][0], "--dry-run" in e["key"], e["rc"]) for e in patch_calls(site)]
    assert calls == [("patch", True, 0), ("patch", False, 0)] * 2
    applied = snapshot(site)
    assert site_patches.apply(site, "vllm") == record  # again: nothing changes, nothing runs
    assert snapshot(site) == applied and len(patch_calls(site)) == 4


@pytest.mark.parametrize("case", ["other version", "file differs", "already applied",
                                  "patch file changed"])
def test_a_refusal_names_why_and_leaves_the_site_as_it_was(site, case, tmp_path):
    target, before, after = images(PATCH.read_text())
    data = pins.load()
    if case == "other version":
        (site / "vllm-0.24.0.dist-info").rename(site / "vllm-0.25.0.dist-info")
        expected = r"no vllm-0\.24\.0\.dist-info \(holds \['vllm-0\.25\.0\.dist-info'\]\)"
    elif case == "file differs":  # another release's code at that place
        (site / target).write_text(before.replace("Otherwise -1.", "Otherwise minus one."))
        expected = "does not apply to"
    elif case == "already applied":
        (site / target).write_text(after)
        expected = "already applied there, but not recorded"
    else:
        data["pins"][PIN]["sha256"] = "0" * 64
        expected = f"pins.{PIN}: {data['pins'][PIN]['path']} has sha256 [0-9a-f]{{64}}, pinned 0{{64}}"
    untouched = snapshot(site)
    with pytest.raises(SitePatchError, match=expected):
        site_patches.apply(site, "vllm", data=data)
    assert snapshot(site) == untouched
    # the dry runs that refused are recorded (GNU patch through the door), each with its exit
    # code; a refusal before any patch ran (the version, the patch's sha256) ran nothing
    tried = [(e["key"][0], "--dry-run" in e["key"], "--reverse" in e["key"], e["rc"])
             for e in patch_calls(site)]
    assert tried == {"file differs": [("patch", True, False, 1), ("patch", True, True, 1)],
                     "already applied": [("patch", True, False, 1), ("patch", True, True, 0)],
                     }.get(case, [])


def test_the_command_line_says_what_it_did(site, capsys):
    assert site_patches.main(["apply", str(site), "vllm"]) == 0
    assert f"{PIN} applied" in capsys.readouterr().out
    (site / "vllm-0.24.0.dist-info").rename(site / "vllm-0.23.0.dist-info")
    (site / RECORD).unlink()
    assert site_patches.main(["apply", str(site), "vllm"]) == 1
    assert "apply to vllm 0.24.0 only" in capsys.readouterr().err
    with pytest.raises(SitePatchError, match="package pin 'vllmx' is not in pins.yaml"):
        site_patches.apply(site, "vllmx")


def test_a_run_records_the_patched_sites_on_its_path_and_whether_they_changed(site, tmp_path,
                                                                             monkeypatch):
    from lib.core.stage import open_record
    from lib.stages.opening import write_run_json

    target, _, _ = images(PATCH.read_text())
    site_patches.apply(site, "vllm")
    plain = tmp_path / "plain-site"
    plain.mkdir()
    monkeypatch.setenv("PYTHONPATH", f"{plain}:{site}")
    resolved = params.resolve("00_cluster", {"results_dir": str(tmp_path / "results"),
                                             "run_id": "r1"})
    stage = open_record("00_cluster", resolved, write_run_json)
    run = json.loads((stage.run_dir / "run.json").read_text())
    (found,) = run["site_patches"]
    assert found["site"] == str(site) and found["version"] == "0.24.0"
    assert [(p["pin"], p["unchanged"]) for p in found["patches"]] == [(PIN, True),
                                                                       (TIMEOUTS_PIN, True)]
    (site / target).write_text((site / target).read_text() + "# edited after patching\n")
    assert site_patches.applied_on(str(site))[0]["patches"][0]["unchanged"] is False
    monkeypatch.delenv("PYTHONPATH")
    stage = open_record("00_cluster", {**resolved, "run_id": "r2"}, write_run_json)
    assert json.loads((stage.run_dir / "run.json").read_text())["site_patches"] == []


def test_stage_01_verifies_the_project_patch_in_the_checkout(tmp_path):
    from lib.roots import verify as roots

    pin = pins.load()["pins"][PIN]
    door = Door(tmp_path / "run", "01_public_roots")
    ok = roots.verify_patch_file(door, PIN, pin, path=pin["path"], sha256=pin["sha256"])
    assert (ok.status, ok.resolved) == ("VERIFIED", f"sha256:{pin['sha256']}")
    bad = roots.verify_patch_file(door, PIN, pin, path=pin["path"], sha256="1" * 64)
    assert bad.status == "FAIL" and "differs from the pin" in bad.reason
    gone = roots.verify_patch_file(door, PIN, pin, path="patches/none.patch", sha256="1" * 64)
    assert gone.status == "MISSING" and "not in this checkout" in gone.reason


def test_a_patch_pin_names_exactly_one_of_url_and_path():
    base = {"kind": "patch", "level": "cited", "source": "s", "sha256": "a" * 64,
            "applies_to": "p", "order": 1}
    target = {"kind": "pypi", "level": "cited", "source": "s", "package": "x", "version": "1"}
    for pin, expected in (
            ({**base}, "exactly one of url"),
            ({**base, "path": "patches/x.patch", "url": "https://h/x.patch"}, "exactly one of url"),
            ({**base, "path": "../x.patch"}, "a file patches/<name>.patch"),
            ({**base, "path": "patches/x.patch"}, None)):
        problems = pins.validate({"schema": 1, "pins": {"p": target, "q": pin}})
        assert (expected in "\n".join(problems)) if expected else problems == [], (pin, problems)


def test_a_site_unpacked_again_over_its_patched_self_is_patched_again(site):
    """scripts/vllm-site.sh extracts over an existing site: the files go back to vLLM's while the
    record stays. Seen on the H200 (2026-12-01): the record alone said 'applied' and the kernel
    ran unpatched. The files' sha256 decide, not the record."""
    target, before, after = images(PATCH.read_text())
    first = site_patches.apply(site, "vllm")
    (site / target).write_text(before)  # what the second extraction does
    assert site_patches.applied_on(str(site))[0]["patches"][0]["unchanged"] is False
    assert site_patches.apply(site, "vllm") == first
    assert (site / target).read_text() == after
    assert site_patches.applied_on(str(site))[0]["patches"][0]["unchanged"] is True


def test_a_site_of_another_pin_set_takes_that_set_s_package_and_patches(tmp_path):
    """The `current` set's vLLM 0.26.0 site gets the patch pinned for that set; a set whose
    pin drops the patch (the newest releases carry the fix) patches nothing; the base set's
    0.24.0 is refused on a 0.26.0 site, naming the version."""
    target, before, after = images(PATCH.read_text())
    data = pins.load()
    current = pins.select(data, "current")["pins"]
    version = current["vllm"]["version"]
    root = tmp_path / "site"
    (root / f"vllm-{version}.dist-info").mkdir(parents=True)
    (root / target).parent.mkdir(parents=True)
    (root / target).write_text(before)
    with pytest.raises(SitePatchError, match="apply to vllm 0.24.0 only"):
        site_patches.apply(root, "vllm")
    record = site_patches.apply(root, "vllm", pin_set="current")
    assert [p["pin"] for p in record["patches"]] == [PIN] and record["version"] == version
    assert (root / target).read_text() == after
    assert site_patches.patch_pins("vllm", pin_set="newest-2026-12") == []
    assert site_patches.main(["apply", str(root), "vllm", "--pin-set", "current"]) == 0


def test_without_gnu_patch_the_refusal_says_it_is_needed_and_the_site_is_as_it_was(
        site, tmp_path, monkeypatch):
    """No `patch` on PATH: the door records the call it could not start (exit 127) and the
    refusal names GNU patch; nothing of the site changed."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    untouched = snapshot(site)
    with pytest.raises(SitePatchError, match=r"GNU patch is needed to apply 0001-.*\.patch: "
                                             "command not found: patch"):
        site_patches.apply(site, "vllm")
    assert snapshot(site) == untouched
    assert [(e["key"][0], e["rc"]) for e in patch_calls(site)] == [("patch", 127)]
