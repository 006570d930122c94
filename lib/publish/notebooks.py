"""The seven stage notebooks, written from one template so every one stays thin.

`python -m lib.publish.notebooks write` (re)writes notebooks/NN_*.ipynb without outputs; `make reference`
then stores the outputs of a recorded run in them (the committed reference run nbval replays).
"""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat

from lib.stages.registry import SPECS, STAGE_PARAMS

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"

# context None: the cluster profile's (lib.stages.profile), else local
FIXED_DEFAULTS = {"run_id": "", "results_dir": "results"}


def parameters_source(stage: str) -> str:
    lines = ["# Parameters (papermill -p NAME VALUE). None takes the context's default."]
    for name in STAGE_PARAMS[stage]:
        lines.append(f"{name} = {FIXED_DEFAULTS.get(name)!r}")
    return "\n".join(lines)


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


if __name__ == "__main__":
    if sys.argv[1:] != ["write"]:
        sys.exit("usage: python -m lib.publish.notebooks write")
    for p in write_all():
        print(p.relative_to(NOTEBOOK_DIR.parent))
