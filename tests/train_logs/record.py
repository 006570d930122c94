"""Records the rank logs tests/test_train_cluster.py serves as the kube pods' logs (README.md).

    .venv/bin/python tests/train_logs/record.py [DEST]     # default: tests/train_logs

Each case is the real training (lib.bench.moe_train, megatron-core on CPU over gloo) launched
as two nodes on this machine: two torchruns at once, each `--nnodes=2 --node-rank=K
--nproc-per-node=1`, with the argv and environment lib.engines.megatron renders for a node, the
rendezvous on node 0 (127.0.0.1). Each node's stdout and stderr together (as `kubectl logs`
gives a pod's) go to `recorded-<case>-node<K>.log`. The shape is the local context's (07's
defaults there: hidden 64, 8 experts top-2, ...), one rank per node: world 2, EP 2.

Cases: `pass` (every rank runs its 5 steps) and `rank1-dies-after-step2` (node 1's rank raises
after its step 2 line, through die_after_step/sitecustomize.py; node 0's rank then fails on the
broken process group)."""
from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))

from lib.engines import megatron  # noqa: E402
from lib.stages import registry, train  # noqa: E402

NODES = 2
CASES = {"pass": {}, "rank1-dies-after-step2": {
    "PYTHONPATH": str(HERE / "die_after_step"), "TRAIN_DIE_NODE": "1",
    "TRAIN_DIE_AFTER_STEP": "2", "TRAIN_DIE_HOW": "raise"}}
RUN_TIMEOUT_S = 300


def local_shape() -> dict:
    """07's train_* parameters on the local context (the CPU-sized model)."""
    resolved = registry.resolve("07_train", {})
    return {k: resolved[k] for k in registry.TRAIN if k.startswith("train_")}


def node_config() -> megatron.TrainConfig:
    """The local shape, one rank per node on CPU (gloo)."""
    class Local:
        params = registry.resolve("07_train", {})
    return dataclasses.replace(train.train_config(Local(), gpus=0), nproc=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record(case: str, dest: Path) -> list[Path]:
    cfg, port, master = node_config(), free_port(), "127.0.0.1"
    paths, procs = [], []
    for rank in range(NODES):
        argv = megatron.train_argv(cfg, nodes=NODES, node_rank=rank, master_addr=master,
                                   port=port, python=sys.executable)
        env = {**os.environ, **megatron.train_env(master), **CASES[case],
               "TRAIN_NODE_RANK": str(rank)}
        path = dest / f"recorded-{case}-node{rank}.log"
        out = path.open("w")
        procs.append((subprocess.Popen(argv, cwd=REPO, env=env, stdout=out,
                                       stderr=subprocess.STDOUT), out))
        paths.append(path)
    for proc, out in procs:
        proc.wait(timeout=RUN_TIMEOUT_S)
        out.close()
    print(case, [p.returncode for p, _ in procs], [str(p) for p in paths])
    return paths


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    target.mkdir(parents=True, exist_ok=True)
    for name in CASES:
        record(name, target)
