"""Suite-wide: the door's table of cluster identities (lib.core.identities) goes to a folder of
this session's own, never the user's ~/.local/state, and is removed after."""
import os
import shutil
import tempfile

from lib.core.identities import STATE_DIR_ENV

_TABLES = tempfile.mkdtemp(prefix="repro-identities-")
os.environ[STATE_DIR_ENV] = _TABLES  # papermill's kernels and every subprocess inherit it


def pytest_unconfigure(config):
    shutil.rmtree(_TABLES, ignore_errors=True)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def reference_book(tmp_path_factory):
    """The real book, built once per session from every committed run with the reference run's
    notebooks as the stages (tests/test_book.py and tests/test_book_browser.py read it; a build
    is ~40 s here). Its html root."""
    from lib.core.door import REPO_ROOT
    from lib.publish.book import build

    results = REPO_ROOT / "results"
    reference = (results / "REFERENCE").read_text().strip()
    out = tmp_path_factory.mktemp("book")
    build(results / reference, out_root=out)
    return out / "_build" / "html"


# `make test` runs the suite in two phases: everything but the cluster tests on two workers
# (pytest-xdist), then the cluster tests alone on one: those start this host's one Kubernetes
# control plane (fixed ports) or its one Slurm, and wait on daemons with deadlines that a second
# worker's load made them miss (measured: a pod's recreation, a step's SIGTERM line, a /metrics
# read, each late once in two parallel runs).
CLUSTER_FILES = ("test_kube_stages.py", "test_kubeplane.py", "test_manifests.py",
                 "test_slurm_place.py", "test_slurmlocal.py")
# The longest files start first, so that two workers end together (measured with --durations:
# each of these holds tests of one to three minutes).
LONGEST_FIRST = ("test_vllm_stages.py", "test_interrupt.py", "test_sweep.py")


def pytest_configure(config):
    config.addinivalue_line("markers", "cluster: starts the host's control plane or Slurm; "
                                       "run alone, one worker (make test's second phase)")


def pytest_collection_modifyitems(config, items):
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: file order kept
    for item in items:
        if item.path.name in CLUSTER_FILES:
            item.add_marker(pytest.mark.cluster)
