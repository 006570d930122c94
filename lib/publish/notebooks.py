"""The seven stage notebooks, written from one template so every one stays thin.

`python -m lib.publish.notebooks write` (re)writes notebooks/NN_*.ipynb without outputs; `make reference`
then stores the outputs of a recorded run in them (the committed reference run nbval replays).
"""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat

from lib.stages.registry import SPECS

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"

# context None: the cluster profile's (lib.stages.profile), else local
FIXED_DEFAULTS = {"run_id": "", "results_dir": "results"}


def parameters_source(stage: str) -> str:
    """The notebook's `parameters` cell, generated from the stage's model (lib.stages.registry
    MODELS): a line per parameter, `name: type = value  # help; default ...`, which papermill's
    `--help-notebook` reads and prints, as a reader of the notebook sees it."""
    from lib.core.param_model import type_said
    from lib.stages.registry import MODELS, PARAMS, defaults_said

    lines = ["# Parameters (papermill -p NAME VALUE; `papermill --help-notebook` lists them). "
             "None takes the context's default."]
    for name in MODELS[stage].model_fields:
        param = PARAMS[name]
        # papermill's parser reads the first '=' of a line after the name as the assignment
        # and skips a line whose help holds another: 'efa = NCCL...' reads 'efa: NCCL...'
        help_text = " ".join(param.help.split()).replace(" = ", ": ").replace("=", " ")
        lines.append(f"{name}: {type_said(param.rule)} = {FIXED_DEFAULTS.get(name)!r}  "
                     f"# {help_text}; default: {defaults_said(param)}")
    return "\n".join(lines)


def write_parameters_cells(directory: Path = NOTEBOOK_DIR) -> list[Path]:
    """Rewrite the `parameters` cell of each stage notebook from its model, keeping every other
    cell and output (the reference run's outputs `make reference` stored)."""
    changed = []
    for stage in SPECS:
        path = directory / f"{stage}.ipynb"
        notebook = nbformat.read(path, as_version=4)
        cell = next(c for c in notebook.cells if "parameters" in c.metadata.get("tags", []))
        source = parameters_source(stage)
        if cell.source != source:
            cell.source = source
            nbformat.write(notebook, path)
            changed.append(path)
    return changed


def build(stage: str) -> nbformat.NotebookNode:
    spec = SPECS[stage]
    # `import lib.stages.X` binds only `lib`: a stage module's name never shadows a parameter
    # of the same name (02's `image`) before open_stage reads the parameters
    module, title, what = f"lib.stages.{spec.module}", spec.title, "Proves " + spec.proves + "."
    nb = nbformat.v4.new_notebook()
    nb.metadata.update({
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    })
    cells = [
        nbformat.v4.new_markdown_cell(f"# {stage[:2]} · {title}\n\n{what}"),
        nbformat.v4.new_code_cell(parameters_source(stage), metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(
            f"import {module}\nfrom lib.stages.opening import open_stage\n\n"
            f"stage = open_stage({stage!r}, globals())"),
        nbformat.v4.new_code_cell(f"data = {module}.run(stage)"),
        nbformat.v4.new_markdown_cell("## What was measured"),
        nbformat.v4.new_code_cell(f"{module}.show(stage, data)"),
        nbformat.v4.new_markdown_cell("## Gates"),
        nbformat.v4.new_code_cell("stage.finish()"),
    ]
    for i, cell in enumerate(cells):
        cell["id"] = f"{stage[:2]}-{i}"
    nb.cells = cells
    return nb


def write_all(directory: Path = NOTEBOOK_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for stage in SPECS:
        path = directory / f"{stage}.ipynb"
        nbformat.write(build(stage), path)
        paths.append(path)
    return paths


USAGE = ("usage: python -m lib.publish.notebooks write|parameters\n"
         "  write       every notebook anew, without outputs\n"
         "  parameters  only each notebook's parameters cell, from its stage's model")

if __name__ == "__main__":
    if sys.argv[1:] not in (["write"], ["parameters"]):
        sys.exit(USAGE)
    written = write_all() if sys.argv[1] == "write" else write_parameters_cells()
    for p in written:
        print(p.relative_to(NOTEBOOK_DIR.parent))
