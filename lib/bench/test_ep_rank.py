"""DeepEP's tests/elastic/test_ep.py as one rank of torchrun: the cluster form of the kernel test.

test_ep's ``__main__`` starts ``--num-processes`` ranks on its node with
``torch.multiprocessing.spawn``. The public reproduction reports that form overflowing NCCL's
256-node topology XML cap on p5en and ran test_ep under torchrun instead (ANCHORS 1.3 and 4):
torchrun starts one process per GPU and each calls test_ep's per-rank entry
``test_loop(local_rank, num_local_ranks, args)`` itself. That entry keeps ``init_dist``'s
contract (deep_ep/utils/envs.py): ``WORLD_SIZE`` = the number of NODES, ``RANK`` = the node
rank, ``MASTER_ADDR``, ``MASTER_PORT``; its rank is ``RANK * num_local_ranks + local_rank``.
torchrun gives every worker its own process counts in ``WORLD_SIZE``/``RANK``, so before test_ep
is imported they are rewritten from torchrun's ``GROUP_WORLD_SIZE``/``GROUP_RANK``, and
``MASTER_PORT`` is set to the rendezvous port. That port is the one torchrun's agent on node 0
serves its store on (``--master-port``); init_dist's ``tcp://`` store joins it as a client
because torchrun sets ``TORCHELASTIC_USE_AGENT_STORE=True`` (torch.distributed.rendezvous
``_create_c10d_store``), so a worker without that flag is refused here: its rank 0 would try to
bind the port the agent holds.

The ``args`` namespace is test_ep's own: its ``__main__`` block runs, all but its last
statement (the spawn, checked to be one), so every flag and default is the pinned test_ep's and
none is restated here.

    python -m torch.distributed.run --nproc-per-node=N --nnodes=K --node-rank=R \\
        --master-addr=A --master-port=P -m lib.bench.test_ep_rank P <DeepEP>/tests/elastic/test_ep.py \\
        --num-processes N [test_ep's flags]

It imports nothing of the guide (stdlib only): on kube it is one of the files the job's pods get
(lib.engines.deepep.TEST_EP_MODULES).
"""
from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path
from typing import Mapping

USAGE = "usage: python -m lib.bench.test_ep_rank RDZV_PORT TEST_EP_PY [test_ep.py's flags]"
# what torchrun gives every worker (torch.distributed.elastic's local agent) that this reads
TORCHRUN_VARS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "TORCHELASTIC_USE_AGENT_STORE")


class LaunchError(SystemExit):
    """Why this rank cannot call test_ep: the process exits 1 with the message."""

    def __init__(self, message: str):
        super().__init__(f"test_ep_rank: {message}")


def rank_env(environ: Mapping[str, str], rdzv_port: int) -> tuple[int, int, dict[str, str]]:
    """(local rank, local ranks, the variables init_dist must read) from torchrun's worker
    environment: WORLD_SIZE = nodes, RANK = node rank, MASTER_PORT = the rendezvous port."""
    missing = [v for v in TORCHRUN_VARS if v not in environ]
    if missing:
        raise LaunchError(f"{', '.join(missing)} not set: run under torchrun "
                          "(python -m torch.distributed.run ... -m lib.bench.test_ep_rank ...)")
    if environ["TORCHELASTIC_USE_AGENT_STORE"] != "True":
        raise LaunchError("TORCHELASTIC_USE_AGENT_STORE is "
                          f"{environ['TORCHELASTIC_USE_AGENT_STORE']!r}, not 'True': init_dist's "
                          f"rank 0 would try to bind port {rdzv_port}, which torchrun's agent "
                          "holds (use torchrun's static rendezvous: --master-addr/--master-port)")
    try:
        local_rank, local_ranks = int(environ["LOCAL_RANK"]), int(environ["LOCAL_WORLD_SIZE"])
        nodes, node_rank = int(environ["GROUP_WORLD_SIZE"]), int(environ["GROUP_RANK"])
    except ValueError as why:
        raise LaunchError(f"torchrun's rank variables are not integers: {why}") from None
    return local_rank, local_ranks, {"WORLD_SIZE": str(nodes), "RANK": str(node_rank),
                                     "MASTER_PORT": str(rdzv_port)}


def main_block(source: str, path: str) -> list[ast.stmt]:
    """The statements of test_ep's ``if __name__ == '__main__':`` block but its last, which must
    be its spawn of the ranks (else: LaunchError naming what was found)."""
    tree = ast.parse(source, filename=path)
    blocks = [node for node in tree.body if isinstance(node, ast.If)
              and ast.unparse(node.test).replace('"', "'") == "__name__ == '__main__'"]
    if len(blocks) != 1:
        raise LaunchError(f"{path}: {len(blocks)} `if __name__ == '__main__':` blocks, not 1")
    body = blocks[0].body
    last = ast.unparse(body[-1]) if body else "nothing"
    if not last.startswith("torch.multiprocessing.spawn(test_loop"):
        raise LaunchError(f"{path}: its __main__ block ends with {last!r}, not test_ep's "
                          "torch.multiprocessing.spawn(test_loop, ...): this launcher was written "
                          "for that form")
    if not any(isinstance(s, ast.Assign) and [ast.unparse(t) for t in s.targets] == ["args"]
               for s in body):
        raise LaunchError(f"{path}: no `args = ...` in its __main__ block")
    return body[:-1]


def load_test_ep(path: str, flags: list[str]):
    """(test_ep as a module, its args namespace): the module imported from `path` (its folder
    first on sys.path, as when it runs as a script), then its __main__ block but the spawn, run
    in the module's namespace with sys.argv = [path, *flags]."""
    folder = str(Path(path).resolve().parent)
    sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location("test_ep", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["test_ep"] = module
    spec.loader.exec_module(module)
    block = main_block(Path(path).read_text(encoding="utf-8"), path)
    sys.argv = [path, *flags]
    exec(compile(ast.Module(body=block, type_ignores=[]), path, "exec"), module.__dict__)
    return module, module.__dict__["args"]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or not argv[0].isdigit():
        raise LaunchError(f"{USAGE} (given: {argv!r})")
    rdzv_port, path, flags = int(argv[0]), argv[1], argv[2:]
    if not Path(path).is_file():
        raise LaunchError(f"no test_ep.py at {path}")
    local_rank, local_ranks, env = rank_env(os.environ, rdzv_port)
    os.environ.update(env)  # before test_ep (and deep_ep) is imported
    module, args = load_test_ep(path, flags)
    if getattr(args, "num_processes", local_ranks) != local_ranks:
        raise LaunchError(f"--num-processes {args.num_processes} but torchrun started "
                          f"{local_ranks} processes on this node (--nproc-per-node): init_dist "
                          "would number the ranks wrong")
    module.test_loop(local_rank, local_ranks, args)


if __name__ == "__main__":
    main()
