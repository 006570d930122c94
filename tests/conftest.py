"""Suite-wide: the door's table of cluster identities (lib.core.identities) goes to a folder of
this session's own, never the user's ~/.local/state, and is removed after."""
import os
import shutil
import tempfile

from lib.core.identities import STATE_DIR_ENV

_TABLES = tempfile.mkdtemp(prefix="repro-identities-")
os.environ[STATE_DIR_ENV] = _TABLES  # papermill's kernels and every subprocess inherit it
# a cluster profile of the person running the tests never sets the tests' defaults (lib.stages.profile);
# a test that wants one writes its own and points REPRO_PROFILE at it
os.environ["REPRO_PROFILE"] = os.path.join(_TABLES, "no-profile.yaml")


def pytest_unconfigure(config):
    shutil.rmtree(_TABLES, ignore_errors=True)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def reference_book():
    """The real book, built from every committed run with the reference run's notebooks as the
    stages (tests/test_book.py, test_book_browser.py, test_book_sources.py, test_landing.py read
    it). Its html root. A build is ~40 s of CPU, and `make test`'s workers each ran one: it is
    built once per version of what it is made from (every lib/ module, book/, _config.yml,
    _toc.yml, pins.yaml, each run's SHA256SUMS and notes), under a lock the other workers wait
    on, into _build/test-reference-book/<digest>/ (the three newest kept)."""
    import fcntl
    import hashlib

    from lib.core.door import REPO_ROOT
    from lib.publish.book import build

    results = REPO_ROOT / "results"
    reference = (results / "REFERENCE").read_text().strip()
    inputs = [*sorted((REPO_ROOT / "lib").rglob("*.py")), *sorted((REPO_ROOT / "lib").rglob("*.yaml")),
              *sorted((REPO_ROOT / "lib").rglob("*.md")), *sorted((REPO_ROOT / "book").rglob("*")),
              REPO_ROOT / "_config.yml", REPO_ROOT / "_toc.yml", REPO_ROOT / "pins.yaml",
              *sorted(results.glob("*/SHA256SUMS")), *sorted(results.glob("*.notes.md")),
              results / "REFERENCE", results / "REPLAYED"]
    digest = hashlib.sha256()
    for path in inputs:
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0" + path.read_bytes())
    root = REPO_ROOT / "_build" / "test-reference-book"
    root.mkdir(parents=True, exist_ok=True)
    out = root / digest.hexdigest()[:16]
    html = out / "_build" / "html"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker builds; the others wait and read it
        if not (out / "complete").exists():
            shutil.rmtree(out, ignore_errors=True)
            build(results / reference, out_root=out)
            (out / "complete").write_text("")
            for old in sorted((p for p in root.iterdir() if p.is_dir()),
                              key=lambda p: p.stat().st_mtime)[:-3]:
                shutil.rmtree(old, ignore_errors=True)
    return html


# `make test` runs the suite in two phases: everything but the cluster tests on three workers
# (pytest-xdist, a file at a time: --dist loadfile; measured: two workers kept the two cores
# 108% busy of 200, the tests wait on servers, AIPerf's start-up and papermill's kernels as much
# as they compute), then the cluster tests on one: those start this host's one Kubernetes
# control plane (fixed ports) or its one Slurm, and wait on daemons with deadlines that a second
# worker's load made them miss (measured: a pod's recreation, a step's SIGTERM line, a /metrics
# read, each late once in two parallel runs; beside nbval, a kube serve once in three).
#
# A file at a time, because module fixtures are made once per worker that runs one of their
# tests: spread over three workers, test_interrupt.py's chain of real runs was made five times
# (measured, ~110 s each). xdist's --dist loadgroup would group files by mark, but with pytest
# 9.2 it groups nothing (xdist 3.8.0 renames `item._nodeid`, which pytest 9 no longer reads:
# pytest-dev/pytest-xdist#1386, open as of 2026-12-01; checked here with a two-file probe), so
# the long files are split instead (tests/vllm_stage_kit.py).
CLUSTER_FILES = ("test_kube_stages.py", "test_kube_lws.py", "test_kubeplane.py",
                 "test_manifests.py", "test_slurm_place.py", "test_slurm_engines.py",
                 "test_slurmlocal.py", "test_train_cluster.py", "test_kube_faults.py",
                 "test_slurm_faults.py", "test_kube_ab_two_nodes.py", "test_kube_transport_ab.py")
# Of those, the ones on the host's Slurm (marked `slurm`; test_train_cluster.py also starts a
# control plane of its own, on free ports): `make test` runs them beside the kube ones, each
# group one worker, the two daemons sharing no port, file or lock (tests/slurmlocal.py and
# tests/kubeplane.py pick free ports and work under their own tmp folders).
SLURM_CLUSTER_FILES = ("test_slurm_place.py", "test_slurm_engines.py", "test_slurmlocal.py",
                       "test_slurm_faults.py", "test_train_cluster.py")
# make test's second cluster process (marked `cluster_b`): the Slurm files
SECOND_PROCESS_FILES = SLURM_CLUSTER_FILES
# make test's third cluster process (marked `cluster_c`): the kube files of the serving A/B on
# two nodes, the LeaderWorkerSet and the kube faults, each module with a control plane of its
# own on free ports (tests/kube_env.py), so the three processes end near together (measured on
# a fresh machine, 2026-12-07, with the transport A/B here too: kube 265 s, Slurm 331 s, this
# one 370 s; the transport A/B, ~55 s, went to the first; then, on a fresh clone: kube 310 s,
# Slurm 315 s, this one 307 s)
THIRD_PROCESS_FILES = ("test_kube_lws.py", "test_kube_ab_two_nodes.py", "test_kube_faults.py")
# The longest files start first, so that the workers end together (measured with --durations=0
# in make test's unit phase on a fresh 2-core machine, 2026-12-07, a worker's seconds each: the
# vLLM-double files ~220 (deepep_06), ~180 (stages), ~145 (answers, at eight AIPerf cells; four
# since), test_interrupt.py ~105, then ~70 down to ~40).
LONGEST_FIRST = ("test_vllm_deepep_06.py", "test_vllm_stages.py", "test_interrupt.py",
                 "test_vllm_answers.py", "test_book_browser.py", "test_book.py", "test_serve.py",
                 "test_places.py", "test_bench_moe_a2a.py", "test_sweep.py", "test_guide.py",
                 "test_kernel_test_ep.py", "test_load.py")


def pytest_configure(config):
    config.addinivalue_line("markers", "cluster: starts the host's control plane or Slurm; "
                                       "run alone, one worker (make test's second phase)")
    config.addinivalue_line("markers", "slurm: a cluster test on the host's two-node Slurm")
    config.addinivalue_line("markers", "cluster_b: a cluster test of make test's second "
                                       "process (the Slurm files), run beside the first (the "
                                       "kube stages)")
    config.addinivalue_line("markers", "cluster_c: a cluster test of make test's third "
                                       "process (the serving A/B on two kube nodes, the "
                                       "LeaderWorkerSet and the kube faults), run beside "
                                       "the other two")


def pytest_collection_modifyitems(config, items):
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: file order kept
    for item in items:
        if item.path.name in CLUSTER_FILES:
            item.add_marker(pytest.mark.cluster)
        if item.path.name in SLURM_CLUSTER_FILES:
            item.add_marker(pytest.mark.slurm)
        if item.path.name in SECOND_PROCESS_FILES:
            item.add_marker(pytest.mark.cluster_b)
        if item.path.name in THIRD_PROCESS_FILES:
            item.add_marker(pytest.mark.cluster_c)
