"""DeepEP itself: its one build (docker/build_deepep.sh) and its own kernel test
(``tests/elastic/test_ep.py``), the same code path on the cluster (EFA) and on a 2-GPU machine
(intranode NVLink, GIN off).

- ``build_deepep_argv``: the argv of docker/build_deepep.sh for a pin of pins.yaml.
- ``test_ep_argv``: test_ep.py with ``--num-processes N ...`` in one of two launch forms
  (``LAUNCHERS``): ``spawn``, ``python <DeepEP>/tests/elastic/test_ep.py ...`` once per node,
  test_ep spawning its N per-GPU ranks itself (``torch.multiprocessing.spawn``): the form of one
  host, known to work (the committed 2x H200 runs); ``torchrun``, one process per GPU under
  ``python -m torch.distributed.run`` (``--nnodes``, ``--node-rank``, the static rendezvous on
  node 0's ``--master-port``), each calling test_ep's per-rank entry through
  lib.bench.test_ep_rank: the cluster form, because spawn overflows NCCL's 256-node topology
  XML cap on p5en and the public reproduction ran test_ep under torchrun (ANCHORS 1.3 and 4).
  Correctness checks stay ON in both: the argv holds only the flags test_ep_argv sets from its
  own arguments, never ``--skip-check`` (the published gate 1 ran with ``skip_check=True``,
  ANCHORS 1.3 and 4) nor any other flag (``--iters`` is V's, never test_ep's).
- ``test_ep_env``: test_ep's ``init_dist`` contract (``deep_ep/utils/envs.py`` at both pins):
  ``WORLD_SIZE`` = number of NODES, ``RANK`` = node rank, ``MASTER_ADDR``, ``MASTER_PORT`` = the
  rendezvous port; ranks are ``node_rank * num_processes + local_rank``. Plus lib.transport's
  contract for the transport. Under torchrun the node's process is torchrun's agent, which gives
  each worker its own ``WORLD_SIZE``/``RANK`` (process counts) and ``MASTER_PORT``: the env then
  sets none of the three, and lib.bench.test_ep_rank rewrites them in every worker from
  torchrun's ``GROUP_WORLD_SIZE``/``GROUP_RANK`` and the rendezvous port in its argv (R's
  wrapper did the same, ANCHORS 1.3).
- ``TEST_EP_MODULES``: the guide's files a torchrun rank imports (the kube place ships them to
  its pods; lib.places.base.RankJob.modules).
Its gates (exit code, every rank's lines, dispatch+combine p50, the contract, the EFA provider on
every rank) are lib.measure.testep's.

What test_ep.py defines, read in deepseek-ai/DeepEP at b306af06afd412c88e51e71802951606e40b7358
(pin ``deepep``) and dd758caf451848bd150e1046af3d0a73e5fff38d (pin ``deepep_intranode``):
the same argparse flags at both (``TEST_EP_FLAGS``); no PASS marker (correctness is
``assert torch.equal(...)`` unless ``--skip-check``); ``--do-pressure-test`` loops
``range(int(1e9))`` seeds.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from lib.roots import pins as pins_mod
from lib.core.door import REPO_ROOT
from lib.engines.transport import DEFAULT_PLUGIN_PATH, Transport, deepep_pythonpath, transport_env

BUILD_SCRIPT = REPO_ROOT / "docker" / "build_deepep.sh"
TEST_EP_SCRIPT = "test_ep.py"  # inside <DeepEP checkout>/tests/elastic
# How test_ep's ranks start: the stage picks it by its place (one machine: spawn; nodes: torchrun)
# DeepEP V2's two modes (ElasticBuffer's allow_hybrid_mode): hybrid, scale-out then scale-up
# through a node's NVLink, or direct, every rank to every rank. One list for the bounds
# (lib.measure.bounds) and the `deepep_v2_mode` parameter (lib.engines.vllm_args says how each
# engine is given it); hybrid by default, as the published runs and the H200 runs set it.
Mode = Literal["hybrid", "direct"]
MODES: tuple[str, ...] = get_args(Mode)
DEFAULT_MODE: Mode = "hybrid"
Launcher = Literal["spawn", "torchrun"]
LAUNCHERS: tuple[str, ...] = get_args(Launcher)
# pins.yaml's deepseek-ai/DeepEP git pins: the cluster's, and the one built on a GPU machine here
DeepepPin = Literal["deepep", "deepep_intranode"]
TEST_EP_RANK_MODULE = "lib.bench.test_ep_rank"  # torchrun's per-rank entry into test_ep
# What a torchrun rank of test_ep imports of the guide: the wrapper (stdlib only) and its
# packages (lib/__init__.py is empty, lib/bench/__init__.py a docstring); tests/test_guide_modules.py
# imports it with only these files on sys.path.
TEST_EP_MODULES = ("lib/__init__.py", "lib/bench/__init__.py", "lib/bench/test_ep_rank.py")

# argparse flags of tests/elastic/test_ep.py, "value" (takes one) or "switch" (store_true), read
# at each pin (identical at both: add_argument lines 522-554 at b306af06, 568-600 at dd758ca).
_FLAGS_B306 = {
    "--num-processes": "value", "--num-sms": "value", "--num-qps": "value",
    "--num-allocated-qps": "value", "--num-gpu-timeout-secs": "value",
    "--num-cpu-timeout-secs": "value", "--sl-idx": "value",
    "--num-tokens": "value", "--hidden": "value", "--num-topk": "value", "--num-experts": "value",
    "--do-cpu-sync": "value", "--allow-hybrid-mode": "value",
    "--allow-multiple-reduction": "value", "--prefer-overlap-with-compute": "value",
    "--deterministic": "switch",
    "--seed": "value", "--skip-check": "switch", "--skip-perf-test": "switch",
    "--do-pressure-test": "switch", "--reuse-elastic-buffer": "switch",
    "--test-first-only": "switch", "--unbalanced-ratio": "value",
    "--precise-unbalanced-ratio": "switch", "--masked-ratio": "value",
    "--dump-profile-traces": "value", "--ignore-local-traffic": "switch",
}
TEST_EP_FLAGS: dict[str, dict[str, str]] = {
    "b306af06afd412c88e51e71802951606e40b7358": dict(_FLAGS_B306),
    "dd758caf451848bd150e1046af3d0a73e5fff38d": dict(_FLAGS_B306),
}

# Flags test_ep.py has but this guide never passes, and why (test_ep_argv passes none but its
# own: nothing can ask for them).
REFUSED_FLAGS = {
    "--skip-check": "correctness checks stay ON: test_ep prints no PASS marker, so its "
                    "assert torch.equal(...) checks and the exit code are the only proof "
                    "(the published gate 1 ran with skip_check=True)",
    "--do-pressure-test": "it loops over range(int(1e9)) seeds and never ends",
    "--skip-perf-test": "it prints no timing lines, so no dispatch+combine p50 is recorded",
}
# Set by test_ep_argv's own arguments: the only flags it passes.
SET_BY_BUILDER = ("--num-processes", "--num-tokens", "--hidden", "--num-topk", "--num-experts",
                  "--test-first-only")

# ---- the build ----------------------------------------------------------------------------------
def build_deepep_argv(*, src: str | Path, site: str | Path, log: str | Path, max_jobs: int,
                      pin: DeepepPin = "deepep_intranode", arch_list: str | None = None,
                      python: str = "python3", patched_tree: str | None = None,
                      skip_import: str | None = None, pins_data: dict | None = None) -> list[str]:
    """argv of docker/build_deepep.sh for pins.yaml's ``pin`` (its commit) against the pinned
    nvidia-nccl-cu13 / nvidia-nvshmem-cu13 in ``site``. ``arch_list`` defaults to pins.yaml's
    TORCH_CUDA_ARCH_LIST build arg; ``patched_tree``, a full tree SHA, is the script's check of
    the patched checkout."""
    data = pins_data if pins_data is not None else pins_mod.load()
    entry = data["pins"][pin]
    argv = ["bash", str(BUILD_SCRIPT), "--src", str(src), "--sha", entry["commit"],
            "--site", str(site), "--nccl-version", data["pins"]["nccl"]["version"],
            "--nvshmem-version", data["pins"]["nvshmem"]["version"],
            "--max-jobs", str(max_jobs), "--log", str(log),
            "--arch-list", arch_list or str(data["build_args"]["TORCH_CUDA_ARCH_LIST"]),
            "--python", python]
    if patched_tree is not None:
        argv += ["--patched-tree", patched_tree]
    if skip_import is not None:
        argv += ["--skip-import", skip_import]
    return argv


# ---- the kernel test: argv and env --------------------------------------------------------------
def test_ep_argv(*, python: str, tests_dir: str | Path, num_processes: int, num_tokens: int,
                 hidden: int, num_topk: int, num_experts: int, test_first_only: bool = True,
                 launcher: Launcher = "spawn", nodes: int = 1, node_rank: int = 0,
                 master_addr: str | None = None, rdzv_port: int | None = None) -> list[str]:
    """test_ep.py's argv on one node, ``--num-processes N --num-tokens T --hidden H --num-topk K
    --num-experts E [--test-first-only]``, in the ``launcher``'s form:

    - ``spawn``: ``python <tests_dir>/test_ep.py <flags>``; test_ep spawns the N ranks.
    - ``torchrun``: ``python -m torch.distributed.run --nproc-per-node=N --nnodes=<nodes>
      --node-rank=<node_rank> --master-addr=<master_addr> --master-port=<rdzv_port> -m
      lib.bench.test_ep_rank <rdzv_port> <tests_dir>/test_ep.py <flags>``: torchrun starts the N
      ranks, each calls test_ep's test_loop (lib.bench.test_ep_rank).

    ``tests_dir`` is the DeepEP checkout's ``tests/elastic``. The shape is the stage's (its
    parameter model keeps top-k within the experts and the experts whole per rank); the node,
    its rendezvous and the launcher are its place's. The flags are SET_BY_BUILDER only: never
    ``REFUSED_FLAGS`` (``--skip-check`` above all).
    """
    flags = ["--num-processes", str(num_processes), "--num-tokens", str(num_tokens),
             "--hidden", str(hidden), "--num-topk", str(num_topk),
             "--num-experts", str(num_experts)] + (["--test-first-only"] if test_first_only else [])
    script = str(Path(tests_dir) / TEST_EP_SCRIPT)
    if launcher == "spawn":
        argv = [str(python), script, *flags]
    else:
        argv = [str(python), "-m", "torch.distributed.run", f"--nproc-per-node={num_processes}",
                f"--nnodes={nodes}", f"--node-rank={node_rank}", f"--master-addr={master_addr}",
                f"--master-port={rdzv_port}", "-m", TEST_EP_RANK_MODULE, str(rdzv_port), script,
                *flags]
    assert "--skip-check" not in argv and not any(a.startswith("--skip-check=") for a in argv), \
        "test_ep must run with its correctness checks"
    return argv


def test_ep_env(*, nodes: int, node_rank: int, master_addr: str, rdzv_port: int,
                transport: Transport, nccl_site: str | Path | None,
                plugin_path: str = DEFAULT_PLUGIN_PATH, deepep_dir: str | Path | None = None,
                inherited_pythonpath: str | None = None,
                launcher: Launcher = "spawn") -> dict[str, str]:
    """The environment of test_ep's process on node ``node_rank`` of ``nodes`` (``spawn``: test_ep
    itself; ``torchrun``: torchrun's agent, whose workers inherit it).

    test_ep's ``init_dist``: ``WORLD_SIZE`` = nodes, ``RANK`` = node rank, ``MASTER_ADDR``,
    ``MASTER_PORT`` = ``rdzv_port`` (the same on every node). Under ``torchrun`` only
    ``MASTER_ADDR`` is set here: torchrun sets the other three in each worker, and
    lib.bench.test_ep_rank rewrites them to init_dist's meaning (the port from its argv). Plus
    ``lib.transport.transport_env(transport, nccl_site=...)`` ('efa' on the cluster,
    'intranode_nvlink' on one machine: EP_DISABLE_GIN=1 and the NCCL preload), and, when
    ``nccl_site`` is given, DeepEP's own NCCL root variables pointing into it
    (``EP_NCCL_ROOT_DIR``, ``NCCL_DIR``: deep_ep checks at import that the loaded libnccl is the
    one it finds there). ``NCCL_DEBUG=INFO`` with INIT,NET,ENV: NCCL's per-rank init lines and,
    on EFA, the plugin's "Selected provider is efa" per process are the per-rank evidence.
    The transport's variables that must be absent: ``lib.transport.unset_vars(transport)``.
    ``deepep_dir``: a DeepEP built in place (a GPU machine, not the image, where deep_ep is
    installed): PYTHONPATH = ``lib.transport.deepep_pythonpath(nccl_site, deepep_dir,
    inherited_pythonpath)``; it needs ``nccl_site``. On ``intranode_nvlink`` (one machine, one
    node) the site is the stage's ``nccl_site``, which its parameter model asks for whenever
    ``deepep_dir`` is given: DeepEP built for it segfaults on torch's own NCCL unless it is
    preloaded.
    """
    env = ({"WORLD_SIZE": str(nodes), "RANK": str(node_rank)} if launcher == "spawn" else {})
    env["MASTER_ADDR"] = str(master_addr)
    if launcher == "spawn":
        env["MASTER_PORT"] = str(rdzv_port)
    env.update({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV"})
    if nccl_site:
        root = str(Path(nccl_site) / "nvidia" / "nccl")
        env["EP_NCCL_ROOT_DIR"] = root
        env["NCCL_DIR"] = root
    env.update(transport_env(transport, nccl_site=nccl_site, plugin_path=plugin_path))
    if deepep_dir is not None:  # with its nccl_site (the parameter model asks for both)
        env["PYTHONPATH"] = deepep_pythonpath(nccl_site, deepep_dir, inherited_pythonpath)
    return env


# Their names start with "test_": tell pytest they are not tests when a test module imports them.
test_ep_argv.__test__ = False  # type: ignore[attr-defined]
test_ep_env.__test__ = False  # type: ignore[attr-defined]
