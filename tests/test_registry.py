"""The one registry of stages and parameters, and everything that must agree with it."""
from __future__ import annotations

import json

import yaml

from lib.core.door import REPO_ROOT
from lib.publish import notebooks
from lib.stages import registry


def test_the_readme_stage_table_is_the_registry_s():
    table = "| notebook | proves |\n|---|---|\n" + "".join(
        f"| `{s.name}` | {s.proves} |\n" for s in registry.SPECS.values())
    assert table in (REPO_ROOT / "README.md").read_text()


def test_the_book_s_toc_lists_every_stage_notebook_in_order():
    toc = yaml.safe_load((REPO_ROOT / "_toc.yml").read_text())
    chapters = [c for part in toc["parts"] for c in part["chapters"]]
    stages = next(c for c in chapters if c["file"] == "book/stages/index")
    # each stage one page, in order, under the stages' index: its prose, its best evidence and
    # the published run's notebook (lib.publish.book.stage_chapter)
    assert [s["file"] for s in stages["sections"]] == [f"book/stages/{n}" for n in registry.STAGES]
    for name in registry.STAGES:
        assert (REPO_ROOT / "book" / "stages" / f"{name}.md").is_file(), name


def test_each_committed_notebook_is_its_registry_entry():
    for name, spec in registry.SPECS.items():
        nb = json.loads((REPO_ROOT / "notebooks" / f"{name}.ipynb").read_text())
        title = "".join(nb["cells"][0]["source"])
        assert title.startswith(f"# {name[:2]} · {spec.title}")
        code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
        assert code[0] == notebooks.parameters_source(name)
        assert f"import lib.stages.{spec.module}" in code[1]
        tags = [c["metadata"].get("tags", []) for c in nb["cells"]]
        assert not any("injected-parameters" in t for t in tags)  # papermill -p-less: a new run


def test_upstream_is_what_a_stage_reads():
    assert registry.upstream("05_sweep", "transformers") == ("00_cluster", "04_serve")
    assert registry.upstream("06_multicomm", "vllm") == ("00_cluster", "04_serve")
    assert registry.upstream("06_multicomm", "transformers") == ("00_cluster", "03_kernel_test")
    for name, spec in registry.SPECS.items():  # upstream stages come earlier
        for up in spec.upstream(True) + spec.upstream(False):
            assert registry.STAGES.index(up) < registry.STAGES.index(name)


def test_every_stage_parameter_has_one_rule_and_the_cluster_vocabulary_is_settled():
    for name in {n for names in registry.STAGE_PARAMS.values() for n in names}:
        assert name in registry.PARAMS
    for word in ("plan_for", "kube_context", "namespace", "nodes", "instance_type",
                 "gpus_per_node", "efa_per_node", "image", "model", "model_revision",
                 "all2all_backend", "num_comms", "arm_a_comms", "arm_b_comms", "enforce_eager",
                 "server_timeout_s", "schedule_timeout_s", "job_timeout_s", "keep",
                 "hf_token_secret", "kube_workload", "partition", "account", "time_limit_min",
                 "venv"):
        assert word in registry.PARAMS, word


def test_a_cluster_s_gpus_and_efa_come_from_its_instance_type_and_an_explicit_value_wins():
    p = registry.resolve("00_cluster", {"context": "kube"})
    assert (p["instance_type"], p["gpus_per_node"], p["efa_per_node"]) == ("p5en.48xlarge", 8, 16)
    p = registry.resolve("00_cluster", {"context": "kube", "instance_type": "p5.48xlarge"})
    assert (p["gpus_per_node"], p["efa_per_node"]) == (8, 32)
    p = registry.resolve("00_cluster", {"context": "kube", "efa_per_node": 4})
    assert p["efa_per_node"] == 4


def test_ep_divisibility_refuses_three_nodes_of_the_default_model():
    import pytest

    from lib.core.errors import ParameterError

    with pytest.raises(ParameterError, match=r"'nodes' = 3.*128 routed experts.*24 ranks"):
        registry.resolve("04_serve", {"context": "kube", "nodes": 3})
    assert registry.resolve("04_serve", {"context": "kube", "nodes": 4})["nodes"] == 4
