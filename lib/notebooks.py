"""The seven stage notebooks, written from one template so every one stays thin.

`python -m lib.notebooks write` (re)writes notebooks/NN_*.ipynb without outputs; `make reference`
then stores the outputs of a recorded run in them (the committed reference run nbval replays).
"""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat

from lib.params import STAGE_PARAMS

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"

STAGES = {
    "00_cluster": ("cluster", "Cluster: can this context run the guide?",
                   "Records the host's facts (CPU, memory, GPUs, EFA devices, gdrdrv, hugepages, "
                   "kubectl, Docker) and gates what this context can run."),
    "01_public_roots": ("roots", "Public roots: does every pin resolve at its public source?",
                        "Loads the single pins file and verifies each root where it is "
                        "published: git SHAs, PyPI versions, image tags, installer tarballs, "
                        "Hugging Face revisions, and the drift of open pull-request heads."),
    "02_image": ("image", "Image: is the image what the pins say?",
                 "Lints the Dockerfile and every shell script, checks each version ARG against "
                 "its pin, and builds the image where a Docker engine exists."),
    "03_kernel_test": ("kernel", "Kernel test: does the all-to-all work, and how fast?",
                       "Dispatch and combine of an expert-parallel MoE layer across ranks with "
                       "correctness checked, per-phase p50/p99, beside the bare all-to-all floor "
                       "for the same bytes."),
    "04_serve": ("serve", "Serve: does an MoE model answer over this transport?",
                 "Starts the server, waits for readiness, asserts the model is a Mixture of "
                 "Experts and that a chat request answers with content and usage."),
    "05_sweep": ("sweep", "Sweep: how fast does it serve?",
                 "AIPerf per concurrency level and repeat, warmup excluded; every cell gated on "
                 "exit code, errors, completed requests and cancellation."),
    "06_multicomm": ("lever", "Multicomm: does the EP_NUM_COMMS lever pay here?",
                     "An interleaved A/B of one communicator against several, with repeats and "
                     "the ratio of dispatch+combine p50 with its bootstrap interval."),
}
FIXED_DEFAULTS = {"context": "local", "run_id": "", "results_dir": "results"}


def parameters_source(stage: str) -> str:
    lines = ["# Parameters (papermill -p NAME VALUE). None takes the context's default."]
    for name in STAGE_PARAMS[stage]:
        lines.append(f"{name} = {FIXED_DEFAULTS.get(name)!r}")
    return "\n".join(lines)


def build(stage: str) -> nbformat.NotebookNode:
    module, title, what = STAGES[stage]
    nb = nbformat.v4.new_notebook()
    nb.metadata.update({
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    })
    cells = [
        nbformat.v4.new_markdown_cell(f"# {stage[:2]} · {title}\n\n{what}"),
        nbformat.v4.new_code_cell(parameters_source(stage), metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(
            f"from lib.stage import open_stage\nfrom lib.stages import {module}\n\n"
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
    for stage in STAGES:
        path = directory / f"{stage}.ipynb"
        nbformat.write(build(stage), path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    if sys.argv[1:] != ["write"]:
        sys.exit("usage: python -m lib.notebooks write")
    for p in write_all():
        print(p.relative_to(NOTEBOOK_DIR.parent))
