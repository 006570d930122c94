"""Every parameter bounded, and hostile values refused before any effect.

The hostile values are generated from the parameter table, per kind of rule
(lib.core.params.hostile_values: each bound's edges and beyond, wrong types, shell and YAML
metacharacters, path traversal, empty and oversized strings, NaN and infinities, list items of
the wrong type, lists too long), and tried through the notebooks' own first cell
(lib.stages.opening.open_stage) in every notebook that takes the parameter.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from lib.core import params as rules
from lib.core.door import REPO_ROOT
from lib.core.errors import ParameterError
from lib.core.params import hostile_values
from lib.engines.vllm_args import MAX_EP_NUM_COMMS
from lib.places.instances import INSTANCE_TYPES
from lib.stages import opening, registry
from lib.stages.registry import PARAMS, STAGE_PARAMS, STAGES

RESULTS = REPO_ROOT / "results"
MIN_HOSTILE = 60  # the floor: at least this many distinct hostile values


class Effect(AssertionError):
    """A hostile value got past validation and reached something that acts on the world."""


@pytest.fixture
def effects_forbidden(monkeypatch):
    """open_stage with everything after validation replaced by a tripwire: a value that passes
    validation raises Effect instead of opening a run, checking the machine or writing."""
    def tripwire(*args, **kwargs):
        raise Effect("reached an effect")

    monkeypatch.delenv("REPRO_REPLAY", raising=False)
    for name in ("open_record", "open_replay", "write_run_json"):
        monkeypatch.setattr(opening, name, tripwire)
    monkeypatch.setattr(opening.places, "engine_refusal", tripwire)  # reads this machine
    monkeypatch.setattr(opening.places, "engine_default", tripwire)


def hostile_pairs() -> list[tuple[str, object]]:
    return [(name, value) for name, param in PARAMS.items()
            for value in hostile_values(param.rule)]


def shown(value) -> str:
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."


# ---- every parameter bounded ---------------------------------------------------------------------
def _inner(rule):
    return rule.rule if isinstance(rule, rules.OrEmpty) else rule


def test_every_parameter_has_a_bounded_rule_that_says_what_it_allows():
    kinds = (rules.Integer, rules.Number, rules.OneOf, rules.Flag, rules.Text, rules.Folder,
             rules.IntList, rules.ChoiceList)
    for name, param in PARAMS.items():
        rule = _inner(param.rule)
        assert isinstance(rule, kinds), f"{name}: {type(rule).__name__} is no bounded rule"
        assert param.allowed and param.rule.kind, name
        if isinstance(rule, (rules.Integer, rules.Number)):
            assert rule.low <= rule.high < 2 ** 32, name
            high = f"{rule.high:g}" if isinstance(rule, rules.Number) else str(rule.high)
            assert f"<= {high}" in param.allowed, name
        if isinstance(rule, rules.IntList):
            assert rule.max_items <= 16 and rule.item.high < 2 ** 32, name
        if isinstance(rule, rules.Text):
            assert rule.max_chars <= rules.IMAGE_MAX_CHARS, name
            assert all(len(e) <= rule.max_chars for e in rule.examples), name


def test_each_bound_has_one_source():
    """The bounds that are facts of something else are read from it."""
    gpus = max(t.gpus for t in INSTANCE_TYPES.values())
    efa = max(t.efa for t in INSTANCE_TYPES.values())
    assert (PARAMS["gpus_per_node"].rule.high, PARAMS["ranks"].rule.high) == (gpus, gpus)
    assert PARAMS["efa_per_node"].rule.high == efa
    for name in ("num_comms", "arm_a_comms", "arm_b_comms"):
        assert PARAMS[name].rule.high == MAX_EP_NUM_COMMS
    waits = {PARAMS[n].rule.high for n in ("schedule_timeout_s", "job_timeout_s",
                                           "server_timeout_s")}
    assert waits == {registry.MAX_WAIT_S} == {PARAMS["time_limit_min"].rule.high * 60}
    # a cell at the largest concurrency measures at most MAX_REQUESTS
    per_slot = PARAMS["requests_per_slot"].rule.high
    assert per_slot * PARAMS["concurrency"].rule.item.high <= PARAMS["request_count"].rule.high


@pytest.mark.parametrize("name", [n for n, p in PARAMS.items()
                                  if isinstance(_inner(p.rule), (rules.Integer, rules.IntList))])
def test_integer_bounds_are_not_off_by_one(name):
    rule = _inner(PARAMS[name].rule)
    item = rule.item if isinstance(rule, rules.IntList) else rule
    wrap = (lambda n: [n]) if isinstance(rule, rules.IntList) else (lambda n: n)
    assert rule(wrap(item.low)) == wrap(item.low) and rule(wrap(item.high)) == wrap(item.high)
    for outside in (item.low - 1, item.high + 1):
        with pytest.raises(ValueError):
            rule(wrap(outside))


# ---- hostile values, through the notebooks' first cell -------------------------------------------
def test_hostile_values_are_refused_in_every_notebook_before_any_effect(effects_forbidden):
    pairs = hostile_pairs()
    results_before = sorted(os.listdir(RESULTS))
    tried, accepted, misnamed = 0, [], []
    for stage in STAGES:
        for name in STAGE_PARAMS[stage]:
            for value in hostile_values(PARAMS[name].rule):
                tried += 1
                try:
                    opening.open_stage(stage, {name: value})
                except ParameterError as err:
                    message = str(err)
                    if err.name != name or f"parameter {name!r}" not in message \
                            or PARAMS[name].allowed not in message:
                        misnamed.append(f"{stage} {name}={shown(value)}: {message[:200]}")
                except Effect:
                    accepted.append(f"{stage} {name}={shown(value)}")
                else:
                    accepted.append(f"{stage} {name}={shown(value)} (opened)")
    print(f"\nhostile values: {len(pairs)} generated for {len(PARAMS)} parameters, "
          f"{tried} tried across the {len(STAGES)} notebooks' first cells; "
          f"accepted: {len(accepted)}")
    assert len(pairs) >= MIN_HOSTILE
    assert accepted == [], "\n".join(accepted[:40])
    assert misnamed == [], "\n".join(misnamed[:40])
    assert sorted(os.listdir(RESULTS)) == results_before


def test_every_kind_of_hostile_value_is_generated():
    """The generator covers what the issue lists, for every parameter whose rule it concerns."""
    for name, param in PARAMS.items():
        values = hostile_values(param.rule)
        text = [v for v in values if isinstance(v, str)]
        for needle in ("; rm -rf /", "$(id)", "`id`", "|", "&&", "\n", ": {", "*anchor",
                       "!!python/object", "../../etc"):
            assert any(needle in v for v in text), (name, needle)
        assert "/etc" in values and "/" in values and rules.HUGE_TEXT in values, name
        assert any(isinstance(v, dict) for v in values), name
        assert ("" in values) is not param.rule.empty_ok, name
        rule = _inner(param.rule)
        if isinstance(rule, rules.Integer):
            for v in (rule.low - 1, rule.high + 1, True, float(rule.low), "one", [rule.low]):
                assert any(type(v) is type(h) and v == h for h in values), (name, v)
        if isinstance(rule, rules.Number):
            assert "inf" in values and any(v != v for v in values if isinstance(v, float)), name
        if isinstance(rule, rules.IntList):
            too_many = list(range(rule.item.low, rule.item.low + rule.max_items + 1))
            for v in ([str(rule.item.low)], [None], [rule.item.high + 1], too_many):
                assert v in values, (name, v)


@pytest.mark.parametrize("stage, given, name", [
    ("05_sweep", {"concurrency": [10 ** 9]}, "concurrency"),
    ("05_sweep", {"concurrency": "[1000000000]"}, "concurrency"),
    ("05_sweep", {"concurrency": ["1", "2"]}, "concurrency"),
    ("05_sweep", {"concurrency": "1 2"}, "concurrency"),  # once read as [12]
    ("04_serve", {"namespace": "deepep-repro\n"}, "namespace"),  # `$` matched before a newline
    ("04_serve", {"kube_context": "my-eks; rm -rf /"}, "kube_context"),
    ("04_serve", {"image": "registry.example/guide"}, "image"),  # no tag: latest, moving
    ("04_serve", {"image": "registry.example/guide:nightly"}, "image"),
    ("04_serve", {"server_timeout_s": "inf"}, "server_timeout_s"),
    ("04_serve", {"server_timeout_s": float("nan")}, "server_timeout_s"),
    ("04_serve", {"server_timeout_s": True}, "server_timeout_s"),
    ("04_serve", {"model_cache_dir": "/etc"}, "model_cache_dir"),  # a hostPath on the nodes
    ("03_kernel_test", {"nccl_site": "/tmp/a:/tmp/b"}, "nccl_site"),  # two PYTHONPATH entries
    ("03_kernel_test", {"num_tokens": "١٢٨"}, "num_tokens"),  # digits, but not ASCII
    ("00_cluster", {"results_dir": "/"}, "results_dir"),
    ("00_cluster", {"results_dir": "/etc"}, "results_dir"),
    ("00_cluster", {"results_dir": "../../etc"}, "results_dir"),
    ("00_cluster", {"results_dir": "/var/lib/guide"}, "results_dir"),
    ("00_cluster", {"nodes": 10 ** 9}, "nodes"),
    ("00_cluster", {"seed": 2 ** 32}, "seed"),
    ("06_multicomm", {"ab_repeats": 10 ** 9}, "ab_repeats"),
])
def test_the_hostile_values_of_the_report_are_refused_naming_parameter_and_allowed(
        effects_forbidden, stage, given, name):
    with pytest.raises(ParameterError) as err:
        opening.open_stage(stage, given)
    assert err.value.name == name and PARAMS[name].allowed in str(err.value)
    assert repr(given[name]) in str(err.value)


def test_none_is_not_given_and_takes_the_default_it_is_no_way_around_a_rule():
    for stage in STAGES:
        defaults = registry.resolve(stage, {})
        assert registry.resolve(stage, {name: None for name in STAGE_PARAMS[stage]}) == defaults


# ---- the edges that are allowed ------------------------------------------------------------------
# What makes an edge coherent with the rules across parameters (registry._check_together): 32
# nodes are no EP group of the default model, one expert is no multiple of 16 ranks, a deepep_*
# backend on local needs DeepEP built here.
COMPANIONS = {
    "nodes": {"context": "kube", "gpus_per_node": 0},
    "ranks": {"context": "kube"},
    "num_experts": {"context": "kube", "nodes": 1, "ranks": 1, "num_topk": 1},
    "arm_b_comms": {"arm_a_comms": 2},
    "deepep_dir": {"nccl_site": "/tmp/nccl-site"},
    "all2all_backend": {"context": "kube"},
    "ab_backends": {"context": "kube"},
    # 07: whole experts per rank, top-k within them, whole heads
    "train_experts": {"context": "kube", "nodes": 1, "ranks": 1, "train_topk": 1},
    "train_topk": {"train_experts": 64},
    "train_heads": {"train_hidden": 8192},
    # 03's transport A/B: a cluster place and a pin set at GIN type 5's floor
    "transport_ab": {"context": "kube", "pin_set": "newest-2026-12"},
}


# A choice no pin set can take yet, refused with its reason (tests/test_train.py checks it): the
# flex dispatcher needs a megatron-core with DeepEP-V2's ElasticBuffer path, in no release yet.
REFUSED_BY_EVERY_PIN_SET = {("train_dispatcher", "flex")}


# Choices whose place decides them: a transport is one machine's or a cluster's; GIN type 5
# needs a pin set at its NCCL floor (newest-2026-12 pins NCCL 2.31.2).
EDGE_COMPANIONS = {
    ("transport", "intranode_nvlink"): {},
    ("transport", "efa"): {"context": "kube"},
    ("transport", "gin_type5"): {"context": "kube", "pin_set": "newest-2026-12"},
}


def test_the_edges_of_every_bound_are_accepted():
    tried = 0
    for name, param in PARAMS.items():
        stage = next(s for s in STAGES if name in STAGE_PARAMS[s])
        for edge in param.rule.edges():
            if isinstance(edge, str) and (name, edge) in REFUSED_BY_EVERY_PIN_SET:
                continue
            companions = (EDGE_COMPANIONS.get((name, edge)) if isinstance(edge, str) else None)
            companions = COMPANIONS.get(name, {}) if companions is None else companions
            resolved = registry.resolve(stage, {**companions, name: edge})
            assert resolved[name] == param.rule(edge), (name, shown(edge))
            tried += 1
    print(f"\nedges accepted: {tried}")
    assert tried >= 3 * len(PARAMS)


def _verdicts(paths: list[Path]) -> list[str]:
    out = []
    for path in paths:
        try:
            registry.resolve("00_cluster", {"results_dir": str(path)})
            out.append(f"accepted {path}")
        except ParameterError as err:
            out.append(f"refused {err.name} {path}")
    return out


def _verdicts_as(user: int, paths: list[Path]) -> list[str]:
    """_verdicts in a forked child that runs as `user` (the modules are already imported)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setresgid(user, user, user)
            os.setresuid(user, user, user)
            os.write(write, "\n".join(_verdicts(paths)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        said = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return said.splitlines()


def test_a_results_dir_where_the_user_cannot_write_is_refused_and_one_they_can_is_not():
    """As a user who is not root (root may write anywhere): a folder owned by root is refused,
    one owned by the user is accepted."""
    top = Path(tempfile.mkdtemp(prefix="guide-writable-", dir="/tmp"))
    try:
        top.chmod(0o755)
        theirs, mine = top / "theirs", top / "mine"
        theirs.mkdir(mode=0o755)
        mine.mkdir(mode=0o755)
        paths = [theirs / "results", mine / "results"]
        if os.geteuid() == 0:
            user = 65534  # nobody
            os.chown(mine, user, user)
            verdicts = _verdicts_as(user, paths)
        else:
            theirs.chmod(0o555)
            verdicts = _verdicts(paths)
        assert verdicts == [f"refused results_dir {paths[0]}", f"accepted {paths[1]}"]
        assert not paths[0].exists() and not paths[1].exists()  # validating made nothing
    finally:
        (top / "theirs").chmod(0o755)
        shutil.rmtree(top)


def test_a_link_into_a_system_directory_is_the_system_directory(tmp_path):
    (tmp_path / "etc-link").symlink_to("/etc")
    with pytest.raises(ParameterError) as err:
        registry.resolve("00_cluster", {"results_dir": str(tmp_path / "etc-link" / "guide")})
    assert err.value.name == "results_dir"
    assert registry.resolve("00_cluster", {"results_dir": str(tmp_path / "runs")})[
        "results_dir"] == str(tmp_path / "runs")


# ---- recorded runs replay with these bounds ------------------------------------------------------
def _stage_of(folder: str) -> str:
    return folder.split(".")[0]  # 06_multicomm.attempt1: a stage's earlier attempt


def recorded_parameters() -> list[tuple[str, str | None, dict]]:
    """(where, stage, given) of every committed run: each stage's params.json, the values
    papermill injected into each executed notebook (those the stage declares, as open_stage
    reads them), the committed notebooks' parameter cells, and run.json's parameters (stage
    None: each value checked by its own rule)."""
    found: list[tuple[str, str | None, dict]] = []
    for path in sorted(RESULTS.glob("*/*/params.json")):
        found.append((str(path), _stage_of(path.parent.name), json.loads(path.read_text())))
    for path in sorted(RESULTS.glob("*/run.json")):
        found.append((str(path), None, json.loads(path.read_text()).get("parameters", {})))
    for path in sorted(RESULTS.glob("*/notebooks/*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        for cell in cells:
            if "injected-parameters" in cell.get("metadata", {}).get("tags", []):
                assigned = ast.parse("".join(cell["source"])).body
                found.append((str(path), _stage_of(path.stem),
                              {a.targets[0].id: ast.literal_eval(a.value) for a in assigned}))
    for stage in STAGES:  # the committed notebooks' parameter cells
        cells = json.loads((REPO_ROOT / "notebooks" / f"{stage}.ipynb").read_text())["cells"]
        cell = next(c for c in cells if "parameters" in c.get("metadata", {}).get("tags", []))
        assigned = ast.parse("".join(cell["source"])).body  # `name: type = value` lines
        found.append((f"notebooks/{stage}.ipynb", stage,
                      {a.target.id: ast.literal_eval(a.value) for a in assigned}))
    return found


def test_every_committed_run_s_parameters_are_still_allowed():
    checked, refused = 0, []
    for where, stage, recorded in recorded_parameters():
        try:
            if stage is None:
                for name, value in recorded.items():
                    if value is not None:
                        registry.checked(PARAMS[name], value)
            else:
                registry.resolve(stage, {k: v for k, v in recorded.items()
                                         if k in STAGE_PARAMS[stage] and v is not None})
        except ParameterError as err:
            refused.append(f"{where}: {err}")
        checked += 1
    print(f"\nrecorded parameter sets validated: {checked}")
    assert checked >= 60 and refused == [], "\n".join(refused)


# ---- the bounds table ----------------------------------------------------------------------------
def test_the_bounds_table_has_a_row_per_parameter_in_the_words_of_its_refusal():
    rows = registry.parameter_bounds_table()
    assert [r["parameter"] for r in rows] == list(PARAMS)
    assert all(set(r) == {"parameter", "stages", "type", "allowed", "default"} for r in rows)
    by_name = {r["parameter"]: r for r in rows}
    assert by_name["concurrency"]["default"] == \
        "local: 1,2,4; plan, kube, slurm: 4,8,32; local with engine vllm: 4,8,32"
    assert by_name["seed"]["stages"] == "all" and by_name["repeats"]["stages"] == "05"
    for name, row in by_name.items():
        value = hostile_values(PARAMS[name].rule)[0]
        with pytest.raises(ParameterError) as err:
            registry.checked(PARAMS[name], value)
        assert row["allowed"] in str(err.value), name


# ---- papermill, as a person runs it --------------------------------------------------------------
def tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        if path.is_file() and not path.is_symlink():
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


@pytest.mark.parametrize("flag, value", [("-p", "[1000000000]"),  # papermill passes text
                                         ("-y", "concurrency: [1000000000]")])  # a YAML list
def test_papermill_refuses_a_billion_concurrency_and_results_stay_byte_identical(
        tmp_path, flag, value):
    before = tree_digest(RESULTS)
    out = tmp_path / "out.ipynb"
    argv = [sys.executable, "-m", "papermill", "notebooks/05_sweep.ipynb", str(out), "--cwd",
            "notebooks", "--kernel", "python3", "--no-progress-bar"]
    argv += ["-p", "concurrency", value] if flag == "-p" else ["-y", value]
    done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "REPRO_REPLAY"})
    assert done.returncode != 0
    assert "parameter 'concurrency'" in done.stderr
    assert PARAMS["concurrency"].allowed in done.stderr
    failing = [c for c in json.loads(out.read_text())["cells"]
               if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    assert len(failing) == 1 and "open_stage" in "".join(failing[0]["source"])
    assert tree_digest(RESULTS) == before
