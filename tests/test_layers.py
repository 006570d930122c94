"""lib/'s layers, read from the syntax trees (a grep would pass a renamed import):

- every import of lib.* runs down the layers (core < roots < engines < measure < places < stages
  < publish < runner), never up, and no module imports itself back through others (no cycle),
  function-level imports included;
- no stage module reads its context: a stage asks its place (lib.places), so the context's name
  appears in no comparison, attribute or key of lib/stages' modules (the parameter table and
  the opener, which read it to pick the place, are not stages).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from lib.core.door import REPO_ROOT
from lib.stages import registry

LIB = REPO_ROOT / "lib"
LAYERS = ("core", "roots", "engines", "measure", "places", "stages", "publish", "runner")
# Modules outside the subpackages, and the layer each belongs to.
PLACED = {
    "lib.bench": "measure",  # the torch benchmark: a program torchrun runs, named in recorded argv
    "lib.runner": "runner",
    "lib": "core",
}
CONTEXT_NAMES = {"local", "plan", "kube", "slurm"}
NOT_STAGES = {"registry.py", "opening.py", "ab.py", "__init__.py", "refusal.py", "profile.py",
              "transport_ab.py", "specs.py", "rules_places.py", "rules_engines.py"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str | None:
    for prefix, layer in sorted(PLACED.items(), key=lambda kv: -len(kv[0])):
        if module == prefix or module.startswith(prefix + "."):
            if prefix == "lib" and module != "lib":
                break
            return layer
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def lib_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of lib.* in the file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("lib")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lib"):
            for alias in node.names:  # `from lib.x import y`: y may be a module of lib.x
                candidate = f"{node.module}.{alias.name}"
                found.append((node.lineno, candidate if _is_module(candidate) else node.module))
    return found


def _is_module(name: str) -> bool:
    base = REPO_ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(LIB.rglob("*.py"))}


def layer_violations() -> list[str]:
    problems = []
    for name, path in modules().items():
        mine = layer_of(name)
        for line, target in lib_imports(path):
            theirs = layer_of(target)
            if mine is None or theirs is None:
                problems.append(f"{name}:{line} -> {target}: a module outside the layers "
                                f"({', '.join(LAYERS)})")
            elif LAYERS.index(theirs) > LAYERS.index(mine):
                problems.append(f"{name}:{line} ({mine}) imports {target} ({theirs}), a higher "
                                "layer")
    return problems


def import_cycles() -> list[list[str]]:
    graph = {name: sorted({t for _, t in lib_imports(path) if t in modules() and t != name})
             for name, path in modules().items()}
    cycles, state = [], {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in graph.get(node, []):
            if state.get(nxt) == "open":
                cycles.append(trail[trail.index(nxt):] + [nxt] if nxt in trail else [node, nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [node])
    return cycles


def test_every_import_runs_down_the_layers():
    assert layer_violations() == []


def test_no_import_cycle():
    assert import_cycles() == []


def test_the_checks_fail_on_an_upward_import_and_on_a_cycle(tmp_path, monkeypatch):
    """The FAIL path: a core module importing a stage, and two modules importing each other."""
    fake = tmp_path / "lib"
    (fake / "core").mkdir(parents=True)
    (fake / "stages").mkdir()
    for init in (fake / "__init__.py", fake / "core" / "__init__.py",
                 fake / "stages" / "__init__.py"):
        init.write_text("")
    (fake / "core" / "a.py").write_text("from lib.stages import b\n")
    (fake / "stages" / "b.py").write_text("def f():\n    from lib.core import a\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO_ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "LIB", fake)
    assert layer_violations() == ["lib.core.a:1 (core) imports lib.stages.b (stages), a higher "
                                  "layer"]
    assert import_cycles() == [["lib.core.a", "lib.stages.b", "lib.core.a"]]


def context_reads(path: Path) -> list[str]:
    """Where a module reads the context: `.context`, a "context" key, or a comparison with a
    context's name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "context":
            found.append(f"{path.name}:{node.lineno} .context")
        elif isinstance(node, ast.Constant) and node.value == "context":
            found.append(f"{path.name}:{node.lineno} 'context'")
        elif isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                if isinstance(side, ast.Constant) and side.value in CONTEXT_NAMES:
                    found.append(f"{path.name}:{node.lineno} == {side.value!r}")
    return sorted(found, key=lambda f: (int(f.split(":")[1].split()[0]), f))


def test_no_stage_module_reads_its_context():
    stage_modules = [p for p in sorted((LIB / "stages").glob("*.py")) if p.name not in NOT_STAGES]
    assert len(stage_modules) == len({s.module for s in registry.SPECS.values()})
    assert [r for p in stage_modules for r in context_reads(p)] == []


def test_the_context_check_finds_a_context_branch(tmp_path):
    """The FAIL path of the check above, on the three forms a branch takes."""
    branchy = tmp_path / "branchy.py"
    branchy.write_text("def run(stage):\n"
                       "    if stage.context != 'local':\n"
                       "        return stage.params['context']\n"
                       "    return stage['plan_for'] == 'kube'\n")
    assert context_reads(branchy) == ["branchy.py:2 .context", "branchy.py:2 == 'local'",
                                      "branchy.py:3 'context'", "branchy.py:4 == 'kube'"]


@pytest.mark.parametrize("stage", ["00_cluster", "03_kernel_test", "04_serve", "05_sweep",
                                   "06_multicomm"])
def test_every_cluster_side_stage_asks_its_place(stage):
    from lib.stages import registry

    path = LIB / "stages" / f"{registry.SPECS[stage].module}.py"
    assert "places.for_stage(" in path.read_text()


# ---- no stage or place names an engine's flag (lib.engines.base) ------------------------------
def engine_flags() -> dict[str, set[str]]:
    """Every flag an engine renders, over specs that reach each of its branches (leader, worker,
    one machine; EP on and off; eager and graphs; a pinned revision; memory limits)."""
    from lib.engines import catalog
    from lib.engines.base import EngineSpec

    common = dict(model="org/model", max_model_len=2048, gpu_memory_utilization=0.5,
                  served_model_name="m", backend="deepep_v2")
    specs = [
        EngineSpec(role="leader", nodes=2, gpus_per_node=8, rendezvous="s-0.s.ns.svc", rpc_port=29570,
                   revision="a" * 40, **common),
        EngineSpec(role="worker", nodes=2, gpus_per_node=8, start_rank=8, rendezvous="s-0.s.ns.svc",
                   rpc_port=29570, enforce_eager=False, **common),
        EngineSpec(role="local", gpus_per_node=2, expert_parallel=False, cores="0", **common),
    ]
    flags: dict[str, set[str]] = {}
    for engine in catalog.ENGINES.values():
        for spec in specs:
            argv, _ = engine.command(spec)
            for token in argv:
                if token.startswith("--"):
                    flags.setdefault(token, set()).add(engine.name)
    return flags


def flags_named(path: Path, flags) -> list[str]:
    """String constants of a module that are an engine flag, or start with one (`--port 8000`,
    `--port=8000`): code that builds an engine's argv. Prose that mentions a flag is not."""
    where = path.relative_to(LIB) if path.is_relative_to(LIB) else path.name
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            head = node.value.strip().split(" ", 1)[0].split("=", 1)[0]
            if head in flags:
                found.append((node.lineno, node.col_offset, f"{where}:{node.lineno} {head}"))
    return [text for *_, text in sorted(found)]


# Flags an engine shares with the guide's own programs, which stages/kernel.py starts: torchrun's
# --nnodes and --node-rank (SGLang's too), the torch benchmark's --backend (TensorRT-LLM's too)
SHARED_WITH_OUR_PROGRAMS = ("--nnodes", "--node-rank", "--backend")


def test_no_stage_or_place_module_names_an_engine_flag():
    flags = {f: e for f, e in engine_flags().items() if f not in SHARED_WITH_OUR_PROGRAMS}
    assert {"--all2all-backend", "--enable-expert-parallel", "--headless",
            "--continuous-batching", "--moe-a2a-backend", "--dist-init-addr"} <= set(flags)
    modules = sorted([*(LIB / "stages").glob("*.py"), *(LIB / "places").rglob("*.py")])
    assert len(modules) > 15
    assert [f for p in modules for f in flags_named(p, flags)] == []


def test_the_flag_check_finds_an_engine_flag(tmp_path):
    """The FAIL path of the check above: an argv built in a place module."""
    place = tmp_path / "place.py"
    place.write_text('"""Serves with --headless workers (prose: not a finding)."""\n'
                     'argv = ["vllm", "serve", "--headless", "--port=8000"]\n'
                     'more = "--data-parallel-size 16"\n')
    assert flags_named(place, engine_flags()) == [
        "place.py:2 --headless", "place.py:2 --port", "place.py:3 --data-parallel-size"]


# ---- sizes a newcomer can read ------------------------------------------------------------------
PLACE_MODULE_MAX_LINES = 500
FUNCTION_MAX_LINES = 80


def long_functions(path: Path, limit: int = FUNCTION_MAX_LINES) -> list[str]:
    """Functions of a module longer than `limit` lines (decorators not counted)."""
    return [f"{path.name}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for n in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > limit]


def test_no_function_in_lib_is_over_80_lines_and_no_place_module_over_500():
    assert [f for p in sorted(LIB.rglob("*.py")) for f in long_functions(p)] == []
    places = sorted((LIB / "places").rglob("*.py"))
    assert len(places) > 10
    sizes = {str(p.relative_to(LIB)): len(p.read_text().splitlines()) for p in places}
    assert {p: n for p, n in sizes.items() if n > PLACE_MODULE_MAX_LINES} == {}


def test_the_size_checks_find_a_long_function(tmp_path):
    long = tmp_path / "long.py"
    long.write_text("def short():\n    return 1\n\n\ndef long():\n"
                    + "".join(f"    x{k} = {k}\n" for k in range(80)) + "    return 0\n")
    assert long_functions(long) == ["long.py:5 long (82 lines)"]


# ---- one home for processes -----------------------------------------------------------------------
# What starts a process from Python: subprocess, and the os and pty calls beneath it.
PROCESS_STARTERS = {"subprocess", "os.system", "os.popen", "os.fork", "os.forkpty", "pty.spawn",
                    *(f"os.{name}" for name in ("execv", "execve", "execvp", "execvpe", "execl",
                                                "execle", "execlp", "execlpe", "spawnv", "spawnve",
                                                "spawnvp", "spawnvpe", "spawnl", "spawnle",
                                                "posix_spawn", "posix_spawnp"))}
PROCESS_HOME = "lib.core.processes"  # the one module that starts processes (the door calls it)


def process_starts(path: Path) -> list[str]:
    """Where `path` imports subprocess or calls an os/pty process starter: 'line: name'."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] in PROCESS_STARTERS]
        elif isinstance(node, ast.ImportFrom):
            found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                      if node.module == "subprocess"
                      or f"{node.module}.{a.name}" in PROCESS_STARTERS]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and f"{node.value.id}.{node.attr}" in PROCESS_STARTERS):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_every_process_is_started_in_one_module_through_the_door():
    """Issue 42: no module of lib/ but lib.core.processes starts a process (the door starts
    through it; the book build and GNU patch too, each with a transcript of its own)."""
    starts = {name: process_starts(path) for name, path in modules().items()
              if name != PROCESS_HOME}
    assert {name: found for name, found in starts.items() if found} == {}
    assert process_starts(modules()[PROCESS_HOME])  # the check sees what it looks for


def test_the_process_check_finds_each_way_to_start_one(tmp_path):
    for source in ("import subprocess\n", "from subprocess import run\n",
                   "import os\nos.system('x')\n", "import os\nos.execvp('x', ['x'])\n",
                   "from os import posix_spawn\n", "import pty\npty.spawn(['x'])\n"):
        path = tmp_path / "m.py"
        path.write_text(source)
        assert process_starts(path), source
    (tmp_path / "m.py").write_text("import os\nos.environ.get('X')\n")
    assert process_starts(tmp_path / "m.py") == []
