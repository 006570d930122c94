"""Pin sets (pins.yaml `sets:`): the schema and its refusals, what a set resolves to, the committed
sets, the `pin_set` parameter and its record in run.json, and the book page that describes them.
Stage 01's verification of every set, against real servers on 127.0.0.1: tests/test_roots.py."""
from __future__ import annotations

import copy
import json

import pytest

from lib.core.door import REPO_ROOT
from lib.core.errors import ParameterError, PinsError
from lib.roots import pins
from lib.stages import registry

SHA_A, SHA_B = "a" * 40, "b" * 40
COMMITTED = pins.load()
ROLES = ("vllm", "torch", "nccl", "nvshmem", "deepep", "efa_installer", "aiperf_public", "model")


def p(**fields):
    return {"level": "cited", "source": "a test", **fields}


def sample() -> dict:
    return {"schema": 1, "pins": {
        "vllm": p(kind="pypi", package="vllm", version="0.24.0"),
        "deepep": p(kind="git", repo="https://github.com/x/DeepEP", commit=SHA_A),
        "fix": p(kind="patch", path="patches/0001-x.patch", sha256="c" * 64, applies_to="vllm",
                 order=1, sets=["seed", "next"]),
        "trio": p(kind="patch", url="https://h/trio.patch", sha256="d" * 64, applies_to="deepep",
                  order=1),
        "extra": p(kind="pypi", package="aiperf", version="0.10.0"),
    }, "sets": {
        "seed": {"base": True, "level": "served-e2e", "source": "the pins above"},
        "next": {"level": "verified-at-source", "source": "a release", "pins": {
            "vllm": p(kind="pypi", package="vllm", version="0.26.0"),
            "deepep": p(kind="git", repo="https://github.com/x/DeepEP", commit=SHA_B),
            "extra": None,
            "added": p(kind="pypi", package="torch", version="2.11.0")}},
        "other": {"level": "cited", "source": "a sample", "pins": {
            "vllm": p(kind="git", repo="https://github.com/vllm-project/vllm", commit=SHA_B)}},
    }}


# ---- what a set resolves to --------------------------------------------------------------------
def test_a_set_replaces_drops_and_adds_pins_and_patches_follow_what_they_were_made_for():
    data = sample()
    assert pins.validate(data) == []
    assert pins.set_names(data) == ["seed", "next", "other"] and pins.base_set(data) == "seed"
    assert pins.set_pins(data, "seed") == data["pins"]  # the base set: the top-level pins
    nxt = pins.set_pins(data, "next")
    assert list(nxt) == ["vllm", "deepep", "fix", "added"]  # trio left with deepep, extra dropped
    assert nxt["vllm"]["version"] == "0.26.0" and nxt["fix"] is data["pins"]["fix"]
    other = pins.set_pins(data, "other")
    # `fix` names seed and next only; `trio` keeps its deepep, which `other` does not replace
    assert list(other) == ["vllm", "deepep", "trio", "extra"]
    selected = pins.select(data, "next")
    assert selected == {"schema": 1, "pins": nxt} and pins.validate(selected) == []
    with pytest.raises(PinsError, match="pin set 'nope' is not in pins.yaml; sets: seed, next"):
        pins.set_pins(data, "nope")
    with pytest.raises(PinsError, match="defines no sets"):
        pins.set_pins({"schema": 1, "pins": data["pins"]}, "seed")


def test_pin_keys_tell_what_is_verified():
    data = sample()
    same = copy.deepcopy(data["pins"]["deepep"])
    same["source"] = "said differently"
    assert pins.pin_key(same) == pins.pin_key(data["pins"]["deepep"])
    assert pins.pin_key(data["sets"]["next"]["pins"]["deepep"]) != pins.pin_key(same)
    unresolved = p(kind="git", status="unresolved", reason="r")
    assert pins.pin_key(unresolved) != pins.pin_key(copy.deepcopy(unresolved))


@pytest.mark.parametrize("edit, expected", [
    (lambda d: d["sets"]["next"].update(base=True), "exactly one set is the top-level pins"),
    (lambda d: d["sets"]["seed"].pop("base"), "found 0: none"),
    (lambda d: d["sets"]["next"].update(level="measured"), "sets.next: level 'measured'"),
    (lambda d: d["sets"]["next"].pop("source"), "sets.next: source is required"),
    (lambda d: d["sets"]["next"].update(owner="x"), "sets.next: unknown keys owner"),
    (lambda d: d["sets"].update({"Bad Name": {"level": "cited", "source": "s"}}),
     "sets.Bad Name: a set name is lower-case"),
    (lambda d: d["sets"]["seed"].update(pins={"vllm": None}), "the base set is the top-level"),
    (lambda d: d["sets"]["next"]["pins"].update(ghost=None), "sets.next.pins.ghost: null drops"),
    (lambda d: d["sets"]["next"]["pins"]["vllm"].update(sets=["next"]),
     "sets.next.pins.vllm: `sets` belongs on top-level pins"),
    (lambda d: d["sets"]["next"]["pins"]["vllm"].update(dockerfile={"VLLM_VERSION": "version"}),
     "a set's pin maps no Dockerfile ARG"),
    (lambda d: d["sets"]["next"]["pins"]["deepep"].update(commit="d4f41e4e93"),
     "sets.next.pins.deepep: commit 'd4f41e4e93' is not a full 40-hex SHA"),
    (lambda d: d["sets"]["next"]["pins"]["vllm"].update(level="measured-here"),
     "sets.next.pins.vllm: level 'measured-here'"),
    (lambda d: d["pins"]["fix"].update(sets=["seed", "later"]),
     "pins.fix: sets names 'later', which is not a set"),
    (lambda d: d["pins"]["fix"].update(sets=["next"]), "its `sets` must name it"),
    (lambda d: d["pins"]["fix"].update(sets=[]), "sets []: a non-empty list of set names"),
    (lambda d: d["sets"]["next"]["pins"].update(vllm=None), "patch fix applies to 'vllm', which "
                                                           "this set drops"),
    (lambda d: d.update(sets={}), "sets: a non-empty mapping"),
])
def test_every_set_problem_is_named(edit, expected):
    data = sample()
    edit(data)
    problems = "\n".join(pins.validate(data))
    assert expected in problems, problems
    with pytest.raises(PinsError):
        pins.check(data)


def test_pins_without_sets_are_valid_as_they_always_were():
    data = sample()
    del data["sets"]
    for pin in data["pins"].values():
        pin.pop("sets", None)
    assert pins.validate(data) == [] and pins.set_names(data) == [] and not pins.has_sets(data)
    assert pins.base_set(data) is None


def test_the_book_s_rows():
    data = sample()
    rows = pins.set_rows(data)
    assert {(r["set"], r["pin"], r["as"]) for r in rows if r["set"] == "next"} == {
        ("next", "vllm", "this set"), ("next", "deepep", "this set"),
        ("next", "fix", "the base set"), ("next", "added", "this set")}
    assert all(set(r) == {"set", "set_level", "pin", "kind", "what", "level", "source", "as"}
               for r in rows)
    what = {(r["set"], r["pin"]): r["what"] for r in rows}
    assert what[("next", "vllm")] == "vllm==0.26.0"
    assert what[("other", "vllm")] == "vllm-project/vllm@" + SHA_B[:12]
    overview = pins.set_overview(data)
    assert [r["set"] for r in overview] == ["seed", "next", "other"]
    assert overview[0]["base"] == "yes" and overview[1]["vllm"] == "vllm==0.26.0"
    assert overview[1]["patches"] == "fix" and overview[2]["patches"] == ""
    assert overview[1]["aiperf_public"] == ""  # the role the set has no pin for


def test_a_run_recorded_before_sets_used_the_seed_set():
    assert pins.pin_set_of({"run_id": "old"}) == "seed-2026-07" == pins.RECORDED_BEFORE_SETS
    assert pins.pin_set_of({"pin_set": "current"}) == "current"
    for run_json in sorted((REPO_ROOT / "results").glob("*/run.json")):  # every committed run
        assert pins.pin_set_of(json.loads(run_json.read_text())) in pins.set_names(COMMITTED)


# ---- the committed sets ----------------------------------------------------------------------
def test_the_committed_sets():
    data = COMMITTED
    assert pins.validate(data) == []
    assert pins.set_names(data) == ["seed-2026-07", "current", "newest-2026-12",
                                    "aws-sample-2026-09", "sglang-0.5.19", "trtllm-0.21.0"]
    assert pins.base_set(data) == "seed-2026-07" == pins.RECORDED_BEFORE_SETS
    assert pins.set_pins(data, "seed-2026-07") == data["pins"]  # exactly today's pins
    levels = {n: s["level"] for n, s in data["sets"].items()}
    assert levels == {"seed-2026-07": "served-e2e", "current": "verified-at-source",
                      "newest-2026-12": "verified-at-source", "aws-sample-2026-09": "cited",
                      "sglang-0.5.19": "verified-at-source", "trtllm-0.21.0": "cited"}
    for name in pins.set_names(data):  # complete: every role the guide needs, its engine's pin
        resolved = pins.set_pins(data, name)  # in vLLM's place where another engine serves
        engine = next(e for e in ("vllm", "sglang", "tensorrt_llm") if e in resolved)
        need = {r for r in ROLES if r != "vllm"} | {engine}
        assert need <= set(resolved), (name, need - set(resolved))
    assert pins.describe(pins.set_pins(data, "sglang-0.5.19")["sglang"]) == "sglang==0.5.19"
    assert pins.describe(pins.set_pins(data, "trtllm-0.21.0")["tensorrt"]) == \
        "tensorrt==10.11.0.33"
    what = {name: {role: pins.describe(pin) for role, pin in pins.set_pins(data, name).items()}
            for name in pins.set_names(data)}
    assert what["current"]["vllm"] == "vllm==0.26.0"
    assert what["current"]["torch"] == "torch==2.11.0+cu130"
    assert what["current"]["nccl"] == "nvidia-nccl-cu13==2.30.4"
    assert what["current"]["nvshmem"] == "nvidia-nvshmem-cu13==3.4.5"
    assert what["current"]["deepep"] == "deepseek-ai/DeepEP@d4f41e4e9360"
    assert what["newest-2026-12"]["vllm"] == "vllm==0.33.0"
    assert what["newest-2026-12"]["torch"] == "torch==2.14.0+cu130"
    assert what["newest-2026-12"]["nccl"] == "nvidia-nccl-cu13==2.31.2"
    assert what["newest-2026-12"]["efa_installer"] == "1.51.0"
    assert what["aws-sample-2026-09"]["vllm"] == "vllm-project/vllm@14617c2b6c12"
    assert what["aws-sample-2026-09"]["deepep"] == "amazon-contributing/DeepEP@97d8f9bcc1be"
    assert what["aws-sample-2026-09"]["efa_installer"] == "1.50.0"
    # vLLM 0.33.0 needs CPython >= 3.11 (its METADATA): its pins say which Python they install on
    newest = pins.set_pins(data, "newest-2026-12")
    assert newest["vllm"]["python"] == "3.12" and newest["torch"]["python"] == "3.12"
    assert pins.status(newest["base_image"]) == "unresolved"
    # this project's vLLM patch: the sets that need it (book/pin_sets.md), the trio: the seed's
    patch = "vllm_patch_deepep_v2_expert_ids"
    assert [n for n in pins.set_names(data) if patch in pins.set_pins(data, n)] == \
        ["seed-2026-07", "current"]
    # the trio goes with b306af06: the seed's, and the two engine sets that keep the seed's
    # DeepEP build (R's TensorRT-LLM lane built it so; SGLang's set inherits it, book/pin_sets.md)
    assert [n for n in pins.set_names(data) if "deepep_patch_0001" in pins.set_pins(data, n)] == \
        ["seed-2026-07", "sglang-0.5.19", "trtllm-0.21.0"]
    # the Dockerfile builds the base set: its ARGs are unchanged by sets
    assert pins.dockerfile_args(data) == pins.dockerfile_args(pins.select(data, "seed-2026-07"))


# ---- the parameter ----------------------------------------------------------------------------
def test_pin_set_is_one_of_the_committed_sets_default_the_base():
    param = registry.PARAMS["pin_set"]
    assert param.rule.options == tuple(pins.set_names(COMMITTED))
    assert param.default("local") == param.default("kube") == "seed-2026-07"
    for stage in registry.STAGES:
        assert registry.resolve(stage, {})["pin_set"] == "seed-2026-07", stage
    assert registry.resolve("01_public_roots", {"pin_set": "current"})["pin_set"] == "current"
    with pytest.raises(ParameterError, match="pin_set.*one of seed-2026-07, current"):
        registry.resolve("01_public_roots", {"pin_set": "latest"})


def test_every_run_records_its_pin_set(tmp_path):
    from lib.core.stage import open_record
    from lib.stages.opening import write_run_json

    for pin_set in ("seed-2026-07", "current"):
        resolved = registry.resolve("00_cluster", {"results_dir": str(tmp_path / "results"),
                                                   "run_id": f"r-{pin_set}",
                                                   "pin_set": pin_set})
        stage = open_record("00_cluster", resolved, write_run_json)
        run = json.loads((stage.run_dir / "run.json").read_text())
        assert run["pin_set"] == pin_set == run["parameters"]["pin_set"]
        assert pins.pin_set_of(run) == pin_set


# ---- the book page ----------------------------------------------------------------------------
def test_the_book_page_names_every_set_its_level_and_its_vllm():
    page = (REPO_ROOT / "book" / "pin_sets.md").read_text()
    for row in pins.set_overview(COMMITTED):
        assert f"**`{row['set']}`** ({row['level']}" in page, row["set"]
        held = pins.set_pins(COMMITTED, row["set"])
        engine = next(held[e] for e in ("vllm", "sglang", "tensorrt_llm") if e in held)
        said = (f"`{engine['package']}=={engine['version']}`" if engine["kind"] == "pypi"
                else f"`{engine['commit'][:8]}`")
        assert said in page, (row["set"], said)


def test_a_set_s_verdict():
    from lib.roots.verify import Row, set_verdict

    def row(root, status, kind="pypi"):
        return Row(root, kind, "s", f"{root} pinned", None, status,
                   reason="" if status == "VERIFIED" else "why")

    rows = [row("a", "VERIFIED"), row("b", "DRIFT", "git-tag"), row("b", "VERIFIED", "git-commit"),
            row("c", "SKIP"), row("d", "MISSING"), row("e", "FAIL")]
    assert set_verdict({"x": "a", "y": "b"}, rows)[0] == "PASS"  # a moved tag is reported only
    status, counts, reason = set_verdict({"x": "a", "z": "c"}, rows)
    assert (status, counts["SKIP"], reason) == ("SKIP", 1, "1 of 2 checks could not be asked: c")
    status, counts, reason = set_verdict({"x": "a", "z": "c", "w": "d", "v": "e", "u": "d"}, rows)
    assert status == "FAIL" and counts["MISSING"] == 1  # a root two pins share counts once
    assert reason == "d (pypi) MISSING: d pinned: why; e (pypi) FAIL: e pinned: why"
