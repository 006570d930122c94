"""DeepEP's one build (docker/build_deepep.sh) and its own kernel test (lib.deepep): the script's
refusals run for real against a git repository made here (nothing is compiled: a stand-in python
plays setup.py), test_ep's argv and env exactly, and the gates on the real 2x H200 test_ep logs
(../shared/fixtures/deepep-test_ep-2xh200/) and on failures derived from them."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from lib.engines import deepep
from lib.measure import testep
from lib.roots import pins
from lib.core.door import REPO_ROOT
from lib.core.errors import ParameterError
from lib.stages import image, registry
from lib.engines.transport import DEFAULT_PLUGIN_PATH, transport_env, unset_vars

SCRIPT = REPO_ROOT / "docker" / "build_deepep.sh"
SHELLCHECK = REPO_ROOT / ".venv" / "bin" / "shellcheck"
FIXTURES = REPO_ROOT.parent / "shared" / "fixtures" / "deepep-test_ep-2xh200"
LOGS = {tokens: FIXTURES / f"test_ep_{tokens}tok_h7168_top8_e256.log"
        for tokens in (128, 512, 4096)}
B306 = "b306af06afd412c88e51e71802951606e40b7358"
DD758 = "dd758caf451848bd150e1046af3d0a73e5fff38d"


# ---- docker/build_deepep.sh --------------------------------------------------------------------
def git(*args: str, cwd: Path) -> str:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], cwd=cwd, check=True, text=True, capture_output=True,
                          env=env).stdout.strip()


@pytest.fixture
def checkout(tmp_path) -> tuple[Path, str]:
    """A git repository shaped like DeepEP's top (setup.py, deep_ep/, fmt >= 11 headers), one
    commit; returns (path, full SHA)."""
    src = tmp_path / "DeepEP"
    (src / "deep_ep").mkdir(parents=True)
    (src / "third-party" / "fmt" / "include" / "fmt").mkdir(parents=True)
    (src / "third-party" / "fmt" / "include" / "fmt" / "base.h").write_text("// fmt 11\n")
    (src / "setup.py").write_text("# stand-in\n")
    (src / "deep_ep" / "__init__.py").write_text("")
    (src / ".gitignore").write_text("*.so\n")
    git("init", "-q", cwd=src)
    git("add", ".", cwd=src)
    git("-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-qm", "init", cwd=src)
    return src, git("rev-parse", "HEAD", cwd=src)


@pytest.fixture
def site(tmp_path) -> Path:
    """A site-packages folder laid out like nvidia-nccl-cu13 2.30.4 + nvidia-nvshmem-cu13 3.6.5."""
    root = tmp_path / "site"
    for path in ("nvidia_nccl_cu13-2.30.4.dist-info", "nvidia_nvshmem_cu13-3.6.5.dist-info",
                 "nvidia/nccl/lib", "nvidia/nccl/include", "nvidia/nvshmem/lib",
                 "nvidia/nvshmem/include"):
        (root / path).mkdir(parents=True)
    for path in ("nvidia/nccl/lib/libnccl.so.2", "nvidia/nccl/include/nccl.h",
                 "nvidia/nvshmem/lib/libnvshmem_host.so.3",
                 "nvidia/nvshmem/lib/libnvshmem_device.a"):
        (root / path).write_text("x\n")
    return root


def fake_python(tmp_path: Path) -> Path:
    """Plays `python3 setup.py build_ext --inplace` (100 lines; FAKE_BUILD_RC fails it; else one
    deep_ep/_C*.so) and `python3 -c <import probe>` (prints what it was given)."""
    path = tmp_path / "bin" / "python3"
    path.parent.mkdir(exist_ok=True)
    path.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = setup.py ]; then\n'
        '  echo "argv: $*"\n'
        '  echo "env: TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS '
        'EP_NCCL_ROOT_DIR=$EP_NCCL_ROOT_DIR NCCL_DIR=$NCCL_DIR '
        'EP_NVSHMEM_ROOT_DIR=$EP_NVSHMEM_ROOT_DIR NVSHMEM_DIR=$NVSHMEM_DIR"\n'
        '  for i in $(seq 1 100); do echo "nvcc line $i"; done\n'
        '  if [ "${FAKE_BUILD_RC:-0}" != 0 ]; then exit "$FAKE_BUILD_RC"; fi\n'
        "  touch deep_ep/_C.cpython-311-x86_64-linux-gnu.so\n"
        "  exit 0\n"
        "fi\n"
        'if [ "$1" = -c ]; then\n'
        '  echo "probe LD_PRELOAD=$LD_PRELOAD PYTHONPATH=$PYTHONPATH"\n'
        '  echo "ElasticBuffer <class \'deep_ep.buffers.elastic.ElasticBuffer\'>"\n'
        "  exit 0\n"
        "fi\n"
        "exit 9\n")
    path.chmod(0o755)
    return path


def run_script(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], text=True, capture_output=True,
                          env={**os.environ, **(env or {})}, timeout=60)


def script_args(src: Path, sha: str, site: Path, log: Path, *more: str) -> list[str]:
    return ["--src", str(src), "--sha", sha, "--site", str(site), "--nccl-version", "2.30.4",
            "--nvshmem-version", "3.6.5", "--max-jobs", "4", "--log", str(log), *more]


def test_the_script_is_shellcheck_clean_and_strict():
    result = subprocess.run([str(SHELLCHECK), "-f", "gcc", str(SCRIPT)], text=True,
                            capture_output=True)
    assert result.returncode == 0, result.stdout + result.stderr
    text = SCRIPT.read_text()
    code = "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#"))
    assert "set -euo pipefail" in code.splitlines()
    assert image.pipe_grep_quiet(text) == [] and "grep -q" not in code
    assert "| tail" not in code and "|tail" not in code  # the log is never truncated
    assert "git clone" not in code and "submodule update" not in code.replace(
        "Fix: git -C ${SRC} submodule update", "")  # it never fetches source


def test_a_short_sha_is_refused(checkout, site, tmp_path):
    src, sha = checkout
    result = run_script(*script_args(src, sha[:8], site, tmp_path / "build.log"))
    assert result.returncode == 2
    assert f"argument --sha: '{sha[:8]}' is not a full 40-hex commit SHA" in result.stderr
    assert not (tmp_path / "build.log").exists()


def test_a_wrong_sha_fails_loud_naming_both(checkout, site, tmp_path):
    src, sha = checkout
    result = run_script(*script_args(src, B306, site, tmp_path / "build.log"))
    assert result.returncode == 1
    assert f"is at HEAD {sha}, expected --sha {B306}" in result.stderr
    assert result.stderr.startswith("FAIL build_deepep.sh: DeepEP checkout")


def test_a_dirty_checkout_is_not_the_pin(checkout, site, tmp_path):
    src, sha = checkout
    (src / "setup.py").write_text("# edited\n")
    result = run_script(*script_args(src, sha, site, tmp_path / "build.log"))
    assert result.returncode == 1
    assert "1 uncommitted change(s) to tracked files" in result.stderr
    assert "setup.py" in result.stderr


def test_missing_fmt_base_h_fails_with_the_fix(checkout, site, tmp_path):
    src, sha = checkout
    git("rm", "-q", "third-party/fmt/include/fmt/base.h", cwd=src)
    git("-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-qm", "no fmt", cwd=src)
    sha = git("rev-parse", "HEAD", cwd=src)
    result = run_script(*script_args(src, sha, site, tmp_path / "build.log"))
    assert result.returncode == 1
    assert "third-party/fmt/include/fmt/base.h is missing" in result.stderr
    assert "fmt >= 11" in result.stderr
    assert f"git -C {src.resolve()} submodule update --init --recursive" in result.stderr


@pytest.mark.parametrize("what", ["site dir", "nccl wheel", "nccl version", "nvshmem lib"])
def test_a_missing_site_or_wheel_is_named(checkout, site, tmp_path, what):
    src, sha = checkout
    args = script_args(src, sha, site, tmp_path / "build.log")
    if what == "site dir":
        args[args.index("--site") + 1] = str(tmp_path / "no-such-site")
        result = run_script(*args)
        assert result.returncode == 2
        assert f"argument --site: '{tmp_path / 'no-such-site'}' is not a directory" in result.stderr
        return
    if what == "nccl wheel":
        (site / "nvidia_nccl_cu13-2.30.4.dist-info").rmdir()
        (site / "nvidia_nccl_cu13-2.28.9.dist-info").mkdir()
    if what == "nccl version":
        args[args.index("--nccl-version") + 1] = "2.30.5"
    if what == "nvshmem lib":
        (site / "nvidia" / "nvshmem" / "lib" / "libnvshmem_device.a").unlink()
    result = run_script(*args)
    assert result.returncode == 1, result.stderr
    if what == "nccl wheel":
        assert "holds no nvidia_nccl_cu13-2.30.4.dist-info (found: " \
               "nvidia_nccl_cu13-2.28.9.dist-info" in result.stderr
    elif what == "nccl version":
        assert "holds no nvidia_nccl_cu13-2.30.5.dist-info" in result.stderr
    else:
        assert "nvidia/nvshmem/lib/libnvshmem_device.a is missing" in result.stderr


@pytest.mark.parametrize("args, named", [
    (["--sha"], "argument --sha: needs a value"),
    (["--bogus", "1"], "argument --bogus: unknown argument"),
    ([], "argument --src: is required"),
])
def test_argument_errors_name_the_argument(args, named):
    result = run_script(*args)
    assert result.returncode == 2
    assert named in result.stderr


@pytest.mark.parametrize("flag, value, named", [
    ("--max-jobs", "0", "argument --max-jobs: '0' is not an integer >= 1"),
    ("--arch-list", "sm_90", "argument --arch-list: 'sm_90' is not a TORCH_CUDA_ARCH_LIST"),
    ("--patched-tree", "ea1d8986", "argument --patched-tree: 'ea1d8986' is not a full 40-hex"),
    ("--src", "/no/such/DeepEP", "argument --src: '/no/such/DeepEP' is not a directory"),
])
def test_bad_values_name_the_argument(checkout, site, tmp_path, flag, value, named):
    src, sha = checkout
    args = script_args(src, sha, site, tmp_path / "build.log")
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    result = run_script(*args)
    assert result.returncode == 2
    assert named in result.stderr


def test_the_build_runs_setup_py_keeps_the_whole_log_and_imports_with_nccl_preloaded(
        checkout, site, tmp_path):
    src, sha = checkout
    log = tmp_path / "logs" / "build.log"
    python = fake_python(tmp_path)
    result = run_script(*script_args(src, sha, site, log, "--python", str(python),
                                     "--arch-list", "9.0"))
    assert result.returncode == 0, result.stdout + result.stderr
    text = log.read_text()
    nccl = site.resolve() / "nvidia" / "nccl"
    nvshmem = site.resolve() / "nvidia" / "nvshmem"
    assert "argv: setup.py build_ext --inplace" in text
    assert (f"env: TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=4 EP_NCCL_ROOT_DIR={nccl} NCCL_DIR={nccl} "
            f"EP_NVSHMEM_ROOT_DIR={nvshmem} NVSHMEM_DIR={nvshmem}") in text
    assert "nvcc line 1\n" in text and "nvcc line 100\n" in text  # whole
    assert f"probe LD_PRELOAD={nccl}/lib/libnccl.so.2" in text
    # the site first (the pinned NVSHMEM is found there), then the in-place build
    assert f"PYTHONPATH={site.resolve()}:{src.resolve()}" in text
    # the unversioned names setup.py at b306af06 links (-l:libnccl.so, -l:libnvshmem_host.so)
    assert os.readlink(nccl / "lib" / "libnccl.so") == "libnccl.so.2"
    assert os.readlink(nvshmem / "lib" / "libnvshmem_host.so") == "libnvshmem_host.so.3"
    assert "OK: DeepEP" in result.stdout and "imported (deep_ep.ElasticBuffer)" in result.stdout


def test_a_failed_build_prints_the_last_40_lines_and_keeps_the_log_whole(checkout, site,
                                                                         tmp_path):
    src, sha = checkout
    log = tmp_path / "build.log"
    result = run_script(*script_args(src, sha, site, log, "--python", str(fake_python(tmp_path))),
                        env={"FAKE_BUILD_RC": "3"})
    assert result.returncode == 1
    assert "setup.py build_ext --inplace exited 3" in result.stderr
    assert "nvcc line 100\n" in result.stderr and "nvcc line 62\n" in result.stderr
    assert "nvcc line 60\n" not in result.stderr  # only the tail is printed
    text = log.read_text()
    assert all(f"nvcc line {i}\n" in text for i in range(1, 101))  # the log is whole


def test_a_patched_tree_is_checked_instead_of_head(checkout, site, tmp_path):
    src, sha = checkout
    (src / "deep_ep" / "patched.py").write_text("# the trio\n")
    git("add", ".", cwd=src)
    git("-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-qm", "trio", cwd=src)
    tree = git("rev-parse", "HEAD^{tree}", cwd=src)
    python = str(fake_python(tmp_path))
    ok = run_script(*script_args(src, sha, site, tmp_path / "a.log", "--python", python,
                                 "--patched-tree", tree,
                                 "--skip-import", "docker build: no driver"))
    assert ok.returncode == 0, ok.stderr
    assert "import check SKIPPED: docker build: no driver" in ok.stdout
    wrong = run_script(*script_args(src, sha, site, tmp_path / "b.log", "--python", python,
                                    "--patched-tree", "e" * 40))
    assert wrong.returncode == 1
    assert f"HEAD^{{tree}} is {tree}, expected --patched-tree {'e' * 40}" in wrong.stderr


def test_build_argv_comes_from_the_pins():
    data = pins.load()
    argv = deepep.build_deepep_argv(src="/w/DeepEP", site="/w/site", log="/w/build.log",
                                    max_jobs=32)
    assert argv == ["bash", str(SCRIPT), "--src", "/w/DeepEP", "--sha", DD758, "--site", "/w/site",
                    "--nccl-version", data["pins"]["nccl"]["version"], "--nvshmem-version",
                    data["pins"]["nvshmem"]["version"], "--max-jobs", "32", "--log", "/w/build.log",
                    "--arch-list", "9.0", "--python", "python3"]
    assert argv[argv.index("--nccl-version") + 1] == "2.30.4"
    tree = data["pins"]["deepep"]["patched_tree"]
    efa = deepep.build_deepep_argv(src="/opt/DeepEP", site="/s", log="/l", max_jobs=16,
                                   pin="deepep", patched_tree=tree)
    assert efa[efa.index("--sha") + 1] == B306 and "--patched-tree" in efa
    # the pins it builds are pins.yaml's DeepEP git pins (its `pin` type, DeepepPin)
    for pin in typing.get_args(deepep.DeepepPin):
        entry = data["pins"][pin]
        assert entry["kind"] == "git" and "deepseek-ai/DeepEP" in entry["repo"]


# ---- test_ep argv and env ---------------------------------------------------------------------
SHAPE = dict(python="python3", tests_dir="/w/DeepEP/tests/elastic", num_processes=2,
             num_tokens=128, hidden=7168, num_topk=8, num_experts=256)


def test_test_ep_argv_exact():
    assert deepep.test_ep_argv(**SHAPE) == [
        "python3", "/w/DeepEP/tests/elastic/test_ep.py", "--num-processes", "2",
        "--num-tokens", "128", "--hidden", "7168", "--num-topk", "8", "--num-experts", "256",
        "--test-first-only"]
    cluster = deepep.test_ep_argv(**{**SHAPE, "num_processes": 8}, test_first_only=False)
    assert cluster[2:] == ["--num-processes", "8", "--num-tokens", "128", "--hidden", "7168",
                           "--num-topk", "8", "--num-experts", "256"]


@pytest.mark.parametrize("launcher", typing.get_args(deepep.Launcher))
def test_test_ep_argv_passes_only_its_own_flags_so_correctness_checks_stay_on(launcher):
    """No argument reaches a flag the builder does not set: --skip-check, --do-pressure-test and
    --skip-perf-test (REFUSED_FLAGS, each with why) cannot be asked for, nor V's --iters."""
    argv = deepep.test_ep_argv(**SHAPE, launcher=launcher, **NODE1)
    flags = {a for a in argv[argv.index(next(a for a in argv if a.endswith("test_ep.py"))):]
             if a.startswith("--")}
    assert flags == set(deepep.SET_BY_BUILDER)
    assert not flags & set(deepep.REFUSED_FLAGS) and "--iters" not in flags
    assert set(deepep.REFUSED_FLAGS) <= set(deepep.TEST_EP_FLAGS[B306])


def test_test_ep_flags_are_those_read_at_the_pins():
    data = pins.load()
    assert set(deepep.TEST_EP_FLAGS) == {data["pins"]["deepep"]["commit"],
                                         data["pins"]["deepep_intranode"]["commit"]}
    for flags in deepep.TEST_EP_FLAGS.values():
        assert {"--num-processes", "--num-tokens", "--hidden", "--num-topk", "--num-experts",
                "--test-first-only", "--skip-check"} <= set(flags)
        assert "--iters" not in flags
        assert set(deepep.SET_BY_BUILDER) <= set(flags)


@pytest.mark.parametrize("given, name", [
    ({"num_topk": 300}, "num_topk"), ({"num_topk": 16, "num_experts": 8}, "num_topk"),
    ({"num_experts": 255}, "num_experts"), ({"hidden": True}, "hidden"),
    ({"test_ep_tokens": "0"}, "test_ep_tokens"), ({"context": "plan", "num_experts": 24},
                                                  "num_experts"),
])
def test_test_ep_s_shape_is_refused_by_the_stage_s_model_before_any_effect(given, name):
    """What test_ep_argv renders (tokens, hidden, top-k within the experts, whole experts per
    rank) is 03's parameters: its model refuses a shape test_ep cannot run, naming it."""
    with pytest.raises(ParameterError) as err:
        registry.resolve("03_kernel_test", given)
    assert err.value.name == name


def test_test_ep_env_cluster_exact():
    env = deepep.test_ep_env(nodes=2, node_rank=1, master_addr="deepep-0.deepep", rdzv_port=29650,
                             transport="efa", nccl_site=None)
    assert env == {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "deepep-0.deepep",
                   "MASTER_PORT": "29650", "NCCL_DEBUG": "INFO",
                   "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV", **transport_env("efa")}
    assert env["NCCL_GIN_TYPE"] == "2" and env["NCCL_NET_PLUGIN"] == DEFAULT_PLUGIN_PATH
    assert not set(env) & set(unset_vars("efa"))


def test_test_ep_env_intranode_exact():
    env = deepep.test_ep_env(nodes=1, node_rank=0, master_addr="127.0.0.1", rdzv_port=29511,
                             transport="intranode_nvlink", nccl_site="/w/site")
    assert env == {
        "WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511",
        "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV",
        "EP_NCCL_ROOT_DIR": "/w/site/nvidia/nccl", "NCCL_DIR": "/w/site/nvidia/nccl",
        "EP_DISABLE_GIN": "1", "LD_PRELOAD": "/w/site/nvidia/nccl/lib/libnccl.so.2",
        "EP_REUSE_NCCL_COMM": "0", "NCCL_NVLS_ENABLE": "0"}
    assert not set(env) & set(unset_vars("intranode_nvlink"))


def test_test_ep_env_with_an_in_place_build_puts_the_site_then_the_checkout_on_pythonpath():
    env = deepep.test_ep_env(nodes=1, node_rank=0, master_addr="127.0.0.1", rdzv_port=29511,
                             transport="intranode_nvlink", nccl_site="/w/site",
                             deepep_dir="/w/DeepEP", inherited_pythonpath="/w/guide-site:/w/repo")
    assert env["PYTHONPATH"] == "/w/site:/w/DeepEP:/w/guide-site:/w/repo"
    without = deepep.test_ep_env(nodes=1, node_rank=0, master_addr="127.0.0.1", rdzv_port=29511,
                                 transport="intranode_nvlink", nccl_site="/w/site",
                                 deepep_dir="/w/DeepEP")
    assert without["PYTHONPATH"] == "/w/site:/w/DeepEP"


@pytest.mark.parametrize("given, name, words", [
    ({"transport": "tcp"}, "transport", "efa, gin_type5, intranode_nvlink"),
    ({"context": "kube", "transport": "intranode_nvlink"}, "transport", "efa or gin_type5"),
    ({"nodes": 2}, "nodes", "1 on the local context"),
    ({"deepep_dir": "/w/DeepEP"}, "nccl_site", "segfaults on torch's own NCCL"),
])
def test_what_test_ep_env_needs_is_refused_by_the_stage_s_model(given, name, words):
    """test_ep_env takes the contract, the NCCL site and the node as given: intranode_nvlink is
    one machine's (one node, local only), a DeepEP built here comes with its site; 03's model
    refuses anything else before any effect."""
    with pytest.raises(ParameterError) as err:
        registry.resolve("03_kernel_test", given)
    assert err.value.name == name and words in str(err.value)


# ---- the two launch forms -----------------------------------------------------------------------
NODE1 = dict(nodes=2, node_rank=1, master_addr="test-ep-0.test-ep.ns.svc", rdzv_port=8361)


def test_test_ep_argv_torchrun_form_exact():
    """The cluster form: torchrun, one rank per GPU, the static rendezvous on node 0's port;
    each rank enters test_ep through lib.bench.test_ep_rank, given the port, test_ep.py and
    the same test_ep flags as the spawn form."""
    argv = deepep.test_ep_argv(**{**SHAPE, "num_processes": 8}, launcher="torchrun", **NODE1)
    assert argv == [
        "python3", "-m", "torch.distributed.run", "--nproc-per-node=8", "--nnodes=2",
        "--node-rank=1", "--master-addr=test-ep-0.test-ep.ns.svc", "--master-port=8361",
        "-m", "lib.bench.test_ep_rank", "8361", "/w/DeepEP/tests/elastic/test_ep.py",
        "--num-processes", "8", "--num-tokens", "128", "--hidden", "7168", "--num-topk", "8",
        "--num-experts", "256", "--test-first-only"]
    spawn = deepep.test_ep_argv(**{**SHAPE, "num_processes": 8}, **NODE1)  # the node is unused
    assert spawn[2:] == argv[12:] and spawn[:2] == ["python3", argv[11]]


def test_test_ep_env_torchrun_form_leaves_init_dist_s_counts_to_the_wrapper():
    """Under torchrun the node's process is torchrun's agent: WORLD_SIZE, RANK and MASTER_PORT
    are torchrun's to give each worker and lib.bench.test_ep_rank's to rewrite, so none is set;
    the rest is the spawn form's."""
    env = deepep.test_ep_env(**NODE1, transport="efa", nccl_site=None, launcher="torchrun")
    spawn = deepep.test_ep_env(**NODE1, transport="efa", nccl_site=None)
    assert env == {k: v for k, v in spawn.items() if k not in ("WORLD_SIZE", "RANK",
                                                               "MASTER_PORT")}
    assert env["MASTER_ADDR"] == NODE1["master_addr"]


# ---- lib.bench.test_ep_rank: test_ep's per-rank entry under torchrun ----------------------------
# A stand-in for tests/elastic/test_ep.py in its shape at the pins: test_loop(local_rank,
# num_local_ranks, args) the per-rank entry, an init_dist of deep_ep/utils/envs.py's contract
# (gloo here: no GPU), and a __main__ block whose argparse builds `args` and whose last line
# spawns. It imports no torch at the top, so a spawn line that ran would fail on `torch`.
FAKE_TEST_EP = """\
import argparse
import json
import os


def init_dist(local_rank, num_local_ranks):
    import torch.distributed as dist
    ip = os.getenv('MASTER_ADDR', '127.0.0.1')
    port = int(os.getenv('MASTER_PORT', '8361'))
    num_nodes = int(os.getenv('WORLD_SIZE', 1))
    node_rank = int(os.getenv('RANK', 0))
    dist.init_process_group(backend='gloo', init_method=f'tcp://{ip}:{port}',
                            world_size=num_nodes * num_local_ranks,
                            rank=node_rank * num_local_ranks + local_rank)
    return dist


def test_loop(local_rank, num_local_ranks, args):
    record = {'local_rank': local_rank, 'num_local_ranks': num_local_ranks, 'args': vars(args),
              'env': {k: os.environ.get(k) for k in ('WORLD_SIZE', 'RANK', 'MASTER_ADDR',
                                                       'MASTER_PORT')}}
    if os.environ.get('FAKE_INIT_DIST') == '1':
        import torch
        dist = init_dist(local_rank, num_local_ranks)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(out, torch.tensor([dist.get_rank()]))
        record['rank'], record['gathered'] = dist.get_rank(), [int(t) for t in out]
        dist.destroy_process_group()
    name = f"{os.environ['GROUP_RANK']}-{local_rank}.json"
    with open(os.path.join(os.environ['FAKE_OUT'], name), 'w') as fh:
        json.dump(record, fh)


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description='a stand-in of test_ep')
    parser.add_argument('--num-processes', type=int, default=8)
    parser.add_argument('--num-tokens', type=int, default=4096)
    parser.add_argument('--hidden', type=int, default=7168)
    parser.add_argument('--num-topk', type=int, default=6)
    parser.add_argument('--num-experts', type=int, default=256)
    parser.add_argument('--test-first-only', action='store_true')
    parser.add_argument('--skip-check', action='store_true')
    args = parser.parse_args()
    num_processes = args.num_processes
    torch.multiprocessing.spawn(test_loop, args=(num_processes, args), nprocs=num_processes)
"""
TORCHRUN_WORKER = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                   "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True",
                   "WORLD_SIZE": "4", "RANK": "3", "MASTER_ADDR": "node-0", "MASTER_PORT": "1"}


@pytest.fixture
def fake_test_ep(tmp_path) -> Path:
    folder = tmp_path / "DeepEP" / "tests" / "elastic"
    folder.mkdir(parents=True)
    (folder / "test_ep.py").write_text(FAKE_TEST_EP)
    (tmp_path / "out").mkdir()
    return folder / "test_ep.py"


def run_rank(script: Path, env: dict[str, str], *flags: str, port: str = "8361"):
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_WORKER}
    return subprocess.run([sys.executable, "-m", deepep.TEST_EP_RANK_MODULE, port, str(script),
                           *flags], env={**base, "FAKE_OUT": str(script.parents[3] / "out"),
                                          **env}, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60)


def test_the_wrapper_calls_test_loop_with_init_dist_s_contract_and_test_ep_s_own_args(
        fake_test_ep):
    """torchrun's worker 3 of 4 (node 1, local rank 1): test_loop(1, 2, args) with the args
    test_ep's own parser made of the flags (its defaults kept), and WORLD_SIZE = nodes (2),
    RANK = node rank (1), MASTER_PORT = the rendezvous port, MASTER_ADDR as torchrun set it."""
    done = run_rank(fake_test_ep, TORCHRUN_WORKER, "--num-processes", "2", "--num-tokens",
                    "128", "--test-first-only")
    assert done.returncode == 0, done.stderr
    record = json.loads((fake_test_ep.parents[3] / "out" / "1-1.json").read_text())
    assert record == {
        "local_rank": 1, "num_local_ranks": 2,
        "args": {"num_processes": 2, "num_tokens": 128, "hidden": 7168, "num_topk": 6,
                 "num_experts": 256, "test_first_only": True, "skip_check": False},
        "env": {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "node-0", "MASTER_PORT": "8361"}}


@pytest.mark.parametrize("env, flags, why", [
    ({k: v for k, v in TORCHRUN_WORKER.items() if k != "GROUP_RANK"}, ["--num-processes", "2"],
     "GROUP_RANK not set: run under torchrun"),
    ({**TORCHRUN_WORKER, "TORCHELASTIC_USE_AGENT_STORE": "False"}, ["--num-processes", "2"],
     "would try to bind port 8361"),
    (TORCHRUN_WORKER, ["--num-processes", "8"], "--num-processes 8 but torchrun started 2"),
])
def test_the_wrapper_refuses_what_would_number_the_ranks_wrong(fake_test_ep, env, flags, why):
    done = run_rank(fake_test_ep, env, *flags)
    assert done.returncode == 1 and why in done.stderr, done.stderr
    assert not list((fake_test_ep.parents[3] / "out").iterdir())  # test_loop never ran


def test_the_wrapper_refuses_a_test_ep_whose_main_block_does_not_end_in_its_spawn(fake_test_ep):
    fake_test_ep.write_text(FAKE_TEST_EP.replace("    torch.multiprocessing.spawn(",
                                                 "    print(").replace("nprocs=num_processes",
                                                                       "sep=''"))
    done = run_rank(fake_test_ep, TORCHRUN_WORKER, "--num-processes", "2")
    assert done.returncode == 1 and "not test_ep's torch.multiprocessing.spawn" in done.stderr
    done = run_rank(fake_test_ep, TORCHRUN_WORKER, "--num-processes", "2", port="p")
    assert done.returncode == 1 and "usage:" in done.stderr


def test_under_the_real_torchrun_two_nodes_of_two_ranks_meet_through_init_dist_s_contract(
        fake_test_ep, tmp_path):
    """The real torchrun, two agents on this host as nodes 0 and 1 (static rendezvous on one
    port, 2 ranks each), test_ep's argv in the cluster form: every rank's init_dist-shaped
    init_process_group(tcp://MASTER_ADDR:MASTER_PORT, world = nodes x 2, rank = node x 2 +
    local) joins torchrun's agent store and the four all_gather their ranks. torchrun's own
    lines on its stderr (recorded here) leave the test_ep parser's reading of a log unchanged."""
    with socket.socket() as probe:  # a free port for the rendezvous, as the door finds one
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = []
    for node in (0, 1):
        argv = deepep.test_ep_argv(python=sys.executable, tests_dir=fake_test_ep.parent,
                                   num_processes=2, num_tokens=128, hidden=7168, num_topk=8,
                                   num_experts=256, launcher="torchrun", nodes=2, node_rank=node,
                                   master_addr="127.0.0.1", rdzv_port=port)
        env = {**{k: v for k, v in os.environ.items() if k not in TORCHRUN_WORKER
                  and k != "OMP_NUM_THREADS"}, "FAKE_OUT": str(tmp_path / "out"),
               "FAKE_INIT_DIST": "1"}
        procs.append(subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    records = {f.stem: json.loads(f.read_text()) for f in (tmp_path / "out").iterdir()}
    assert sorted(records) == ["0-0", "0-1", "1-0", "1-1"]
    for key, rec in records.items():
        node, local = map(int, key.split("-"))
        assert rec["rank"] == node * 2 + local and rec["gathered"] == [0, 1, 2, 3]
        assert rec["env"] == {"WORLD_SIZE": "2", "RANK": str(node), "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": str(port)}
        assert (rec["num_local_ranks"], rec["args"]["num_processes"]) == (2, 2)
    torchrun_lines = outs[0][1]
    assert "OMP_NUM_THREADS" in torchrun_lines  # torchrun's banner, as a pod's log holds it
    from tests import compose  # noqa: PLC0415

    logs = compose.compose_test_ep(tmp_path / "logs")
    plain = "\n".join(p.read_text() for p in logs)
    mixed = "\n".join(torchrun_lines + p.read_text() for p in logs)
    assert testep.parse_test_ep_text(mixed, source="x") == testep.parse_test_ep_text(plain,
                                                                                     source="x")


# ---- gates on the real logs ---------------------------------------------------------------------
def by_name(gates: list[dict]) -> dict[str, dict]:
    assert all(set(g) == {"gate", "status", "observed", "expected", "reason", "evidence"}
               for g in gates)
    return {g["gate"]: g for g in gates}


@pytest.mark.parametrize("tokens, dc", [(128, 14.776 + 14.413), (512, 22.2955 + 33.2845),
                                        (4096, 106.2145 + 192.1745)])
def test_the_real_logs_pass_with_two_ranks(tokens, dc):
    path = LOGS[tokens]
    gates = by_name(testep.gates_from_test_ep(path.read_text(), 0, num_ranks=2,
                                              evidence=[str(path)], transport="intranode_nvlink"))
    assert [g["status"] for g in gates.values()] == ["PASS", "PASS", "PASS", "SKIP"]
    assert "the exit code is the gate" in gates[testep.GATE_EXIT]["reason"]
    assert gates[testep.GATE_RANKS]["observed"]["ranks_seen"] == [0, 1]
    observed = gates[testep.GATE_DC]["observed"]
    assert observed["dc_p50_us"] == pytest.approx(dc)
    assert observed["num_tokens"] == tokens and observed["ranks_timed"] == 2
    efa = gates[testep.GATE_EFA]
    assert "NVLink" in efa["reason"] and "GIN off" in efa["reason"]
    assert all(g["evidence"][0] == str(path) for g in gates.values())


def test_the_contract_threshold_lives_once_and_gates_only_when_given():
    text = LOGS[128].read_text()
    gates = by_name(testep.gates_from_test_ep(text, 0, num_ranks=2, evidence=["x.log"],
                                              transport="intranode_nvlink",
                                              dc_p50_max_us=testep.CONTRACT_DC_P50_US))
    limit = gates[testep.GATE_DC_MAX]
    assert limit["status"] == "PASS" and testep.CONTRACT_DC_P50_US == 740.0
    assert limit["expected"] == "<= 740 us (the contract; published 443.6 us on 2x p5en EP16)"
    assert testep.published_dc_p50_us() == 443.6
    assert list(by_name(testep.gates_from_test_ep(text, 0, num_ranks=2, evidence=[],
                                                  transport="intranode_nvlink"))) == [
        testep.GATE_EXIT, testep.GATE_RANKS, testep.GATE_DC, testep.GATE_EFA]
    # one source of truth: the number appears once in the library
    found = [(path, path.read_text().count("740")) for path in (REPO_ROOT / "lib").rglob("*.py")]
    assert [(path.name, n) for path, n in found if n] == [("testep.py", 1)]


def test_a_threshold_below_the_measured_dc_fails():
    gates = by_name(testep.gates_from_test_ep(LOGS[512].read_text(), 0, num_ranks=2,
                                              evidence=[], transport="intranode_nvlink",
                                              dc_p50_max_us=50.0))
    failed = gates[testep.GATE_DC_MAX]
    assert failed["status"] == "FAIL"
    assert failed["reason"] == "D+C p50 55.580 us > 50 us: slower than the threshold"


def test_a_dropped_rank_fails_naming_it():
    text = "\n".join(line for line in LOGS[128].read_text().splitlines()
                     if "EP:   1/2" not in line)
    gates = by_name(testep.gates_from_test_ep(text, 0, num_ranks=2, evidence=[],
                                              transport="intranode_nvlink",
                                              dc_p50_max_us=testep.CONTRACT_DC_P50_US))
    ranks = gates[testep.GATE_RANKS]
    assert ranks["status"] == "FAIL"
    assert ranks["reason"].startswith("rank(s) 1 of 2 printed no lines in case 'tokens=128 |")
    assert ranks["observed"]["missing_ranks"] == [1]
    assert gates[testep.GATE_DC]["status"] == "FAIL"  # a p50 over part of the ranks
    assert "timed on 1 of 2 ranks" in gates[testep.GATE_DC]["reason"]
    assert gates[testep.GATE_DC_MAX]["status"] == "FAIL"


def test_a_rank_missing_one_phase_is_named():
    text = "\n".join(line for line in LOGS[4096].read_text().splitlines()
                     if not line.lstrip().startswith("+ EP:   0/2"))
    ranks = by_name(testep.gates_from_test_ep(text, 0, num_ranks=2, evidence=[],
                                              transport="intranode_nvlink"))[testep.GATE_RANKS]
    assert ranks["status"] == "FAIL" and "rank 0 lacks reduced combine" in ranks["reason"]


def test_more_ranks_expected_than_printed_fails():
    ranks = by_name(testep.gates_from_test_ep(LOGS[128].read_text(), 0, num_ranks=16,
                                              evidence=[], transport="efa"))[testep.GATE_RANKS]
    assert ranks["status"] == "FAIL"
    assert "rank(s) 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15 of 16" in ranks["reason"]
    assert "printed EP sizes [2], expected 16" in ranks["reason"]


@pytest.mark.parametrize("rc, reason", [
    (1, "test_ep failed (test_ep: exit 1)"),
    (None, "test_ep: no exit code (timed out or never ran)"),
    ({"deepep-0": 0, "deepep-1": 1}, "test_ep failed (deepep-1: exit 1)"),
    ([0, 134], "node 1: exit 134"),
])
def test_a_nonzero_exit_fails(rc, reason):
    gates = by_name(testep.gates_from_test_ep(LOGS[128].read_text(), rc, num_ranks=2,
                                              evidence=[], transport="intranode_nvlink"))
    exit_gate = gates[testep.GATE_EXIT]
    assert exit_gate["status"] == "FAIL" and reason in exit_gate["reason"]
    assert gates[testep.GATE_RANKS]["status"] == "PASS"  # the other gates stand on their own


def test_no_test_ep_lines_fail_every_gate_with_the_parser_reason():
    gates = by_name(testep.gates_from_test_ep("Traceback ...\nRuntimeError: NCCL error\n", 1,
                                              num_ranks=2, evidence=["n0.log"],
                                              transport="intranode_nvlink"))
    assert [g["status"] for g in gates.values()] == ["FAIL", "FAIL", "FAIL", "SKIP"]
    assert "no test_ep.py per-rank phase lines" in gates[testep.GATE_RANKS]["reason"]


# ---- the EFA provider line (lines in the format NCCL and aws-ofi-nccl 1.21.1 print) ------------
def efa_log(providers: dict[int, str]) -> str:
    """The 128-token log as if run on EFA: per process an NCCL init line (tying pid to rank) and
    the plugin's provider line."""
    lines = []
    for rank, provider in providers.items():
        pid = 4100 + rank
        lines.append(f"node0:{pid}:{pid} [{rank}] NCCL INFO ncclCommInitRank comm 0x5500{rank} "
                     f"rank {rank} nranks 2 cudaDev {rank} nvmlDev {rank} busId 1{rank}000 "
                     f"commId 0xabc - Init COMPLETE")
        if provider:
            lines.append(f"node0:{pid}:{pid} [{rank}] NCCL INFO NET/OFI Selected provider is "
                         f"{provider}, fabric is efa-direct (found 16 nics)")
    return "\n".join(lines) + "\n" + LOGS[128].read_text()


def test_the_efa_provider_on_every_rank():
    gates = by_name(testep.gates_from_test_ep(efa_log({0: "efa", 1: "efa"}), 0, num_ranks=2,
                                              evidence=["n0.log"], transport="efa"))
    assert gates[testep.GATE_EFA]["status"] == "PASS"
    assert gates[testep.GATE_EFA]["evidence"][0] == "n0.log"
    assert [g["status"] for g in gates.values()] == ["PASS"] * 4


def test_a_rank_without_efa_or_on_tcp_fails():
    missing = by_name(testep.gates_from_test_ep(efa_log({0: "efa", 1: ""}), 0, num_ranks=2,
                                                evidence=[], transport="efa"))[testep.GATE_EFA]
    assert missing["status"] == "FAIL" and "rank(s) 1 of 2" in missing["reason"]
    tcp = by_name(testep.gates_from_test_ep(efa_log({0: "efa", 1: "tcp;ofi_rxm"}), 0,
                                            num_ranks=2, evidence=[], transport="efa"))
    assert tcp[testep.GATE_EFA]["status"] == "FAIL"
    assert "tcp;ofi_rxm" in tcp[testep.GATE_EFA]["reason"]
    intranode_log_on_efa = by_name(testep.gates_from_test_ep(LOGS[128].read_text(), 0,
                                                             num_ranks=2, evidence=[],
                                                             transport="efa"))
    assert intranode_log_on_efa[testep.GATE_EFA]["status"] == "FAIL"


# ---- the transport that loaded, per rank (tests/compose.py: NCCL's own lines) -------------------
def composed_gates(tmp_path, transport: str, **variant) -> dict[str, dict]:
    """03's gates over test_ep composed on 2 nodes x 8 ranks over EFA (tests/compose.py)."""
    from tests import compose  # noqa: PLC0415

    logs = compose.compose_test_ep(tmp_path / "logs", **variant)
    return by_name(testep.gates_from_test_ep("\n".join(p.read_text() for p in logs), [0, 0],
                                             num_ranks=16, evidence=[str(p) for p in logs],
                                             transport=transport))


def test_a_type5_run_passes_only_where_every_rank_loaded_type5(tmp_path):
    passed = composed_gates(tmp_path / "a", "gin_type5", gin_type=5)
    assert passed[testep.GATE_GIN]["status"] == "PASS"
    assert passed[testep.GATE_GIN]["observed"]["type_per_rank"] == {str(r): 5 for r in range(16)}
    # type 2 asks nothing of the GIN line: no such gate
    assert testep.GATE_GIN not in composed_gates(tmp_path / "b", "efa")
    # rank 9 asked for type 5 (its pod's env) and NCCL assigned it the type-2 plugin
    loaded_2 = composed_gates(tmp_path / "c", "gin_type5", gin_type=5, gin_type_of_rank={9: 2})
    failed = loaded_2[testep.GATE_GIN]
    assert failed["status"] == "FAIL" and failed["reason"].startswith("rank 9: type 2, not GIN")
    assert any(e.endswith("GIN/Plugin: Assigned plugin Libfabric type 2 to comm")
               for e in failed["evidence"])
    assert loaded_2[testep.GATE_EFA]["status"] == "PASS"  # the provider was EFA all along


def test_a_rank_that_fell_back_to_socket_fails_the_efa_gate_naming_it(tmp_path):
    """The silent fallback: the plugin selected EFA's provider on every rank, yet rank 4's NCCL
    used its internal Socket network (ANCHORS section 6)."""
    gates = composed_gates(tmp_path, "efa", network_of_rank={4: "Socket"})
    efa = gates[testep.GATE_EFA]
    assert efa["status"] == "FAIL"
    assert efa["reason"].startswith("rank 4 used network Socket, not Libfabric")
    assert efa["observed"]["not_libfabric"] == {"rank 4": "Socket"}
    assert any(e.endswith("NCCL INFO Using network Socket") for e in efa["evidence"])
    assert composed_gates(tmp_path / "ok", "efa")[testep.GATE_EFA]["status"] == "PASS"
