"""Stage 03: the all-to-all works (correctness) and how fast (per-phase p50/p99, beside its floor).

On the local context: lib.bench.moe_a2a under torchrun, gloo on CPU, NCCL on two or more GPUs.
"""
from __future__ import annotations

import json
import sys

from lib.bench import result as bench_result
from lib.hardware import cuda_device_count
from lib.evidence import Gate, skip
from lib.stage import Stage

CPU_HIDDEN = 256  # a smaller hidden on CPU keeps the stage in seconds; GPUs use test_ep's 7168
GPU_HIDDEN = 7168
TORCHRUN_TIMEOUT_S = 600


def device_count(stage: Stage) -> int:
    return cuda_device_count(stage.door)


def bench_config(stage: Stage, gpus: int, num_comms: int | None = None) -> dict:
    p = stage.params
    on_gpu = gpus >= 2
    return {
        "nproc": min(p["ranks"], gpus) if on_gpu else p["ranks"],
        "backend": "nccl" if on_gpu else "gloo",
        "num_tokens": p["num_tokens"],
        "hidden": p["hidden"] or (GPU_HIDDEN if on_gpu else CPU_HIDDEN),
        "num_topk": p["num_topk"],
        "num_experts": p["num_experts"],
        "num_comms": num_comms or p["num_comms"],
        "iters": p["iters"],
        "warmup": p["warmup"],
        "seed": p["seed"],
    }


def torchrun_argv(cfg: dict, port: int, out: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg['nproc']}",
        "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "lib.bench.moe_a2a",
        "--num-tokens", cfg["num_tokens"], "--hidden", cfg["hidden"], "--num-topk",
        cfg["num_topk"], "--num-experts", cfg["num_experts"], "--num-comms", cfg["num_comms"],
        "--iters", cfg["iters"], "--warmup", cfg["warmup"], "--seed", cfg["seed"],
        "--backend", cfg["backend"], "--out", out,
    ]


def run_bench(stage: Stage, cfg: dict, name: str) -> tuple[dict | None, list[dict]]:
    """One torchrun of the benchmark: its result JSON (None when absent) and its gates."""
    out = stage.path(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    port = stage.door.free_port()
    call = stage.door.run(torchrun_argv(cfg, port, str(out)), timeout=TORCHRUN_TIMEOUT_S,
                          env={"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}, check=False)
    streams = [f"calls/{stage.name}/{call.seq:04d}.stdout", f"calls/{stage.name}/{call.seq:04d}.stderr"]
    result = json.loads(out.read_text()) if out.exists() else None
    evidence = ([stage.rel(out)] if out.exists() else []) + streams
    return result, bench_result.gates_from_result(result, call.rc, call.stderr, evidence)


def run(stage: Stage) -> dict:
    if stage.context != "local":
        stage.add(skip("test_ep via torchrun", f"the {stage.context} context's kernel test "
                       "(DeepEP tests/elastic/test_ep.py, one torchrun per node) is not built yet"))
        return {"result": None}
    gpus = device_count(stage)
    cfg = bench_config(stage, gpus)
    print(f"torchrun: {cfg['nproc']} ranks on {cfg['backend']}, {cfg['num_tokens']} tokens x "
          f"hidden {cfg['hidden']}, top-{cfg['num_topk']} of {cfg['num_experts']} experts, "
          f"{cfg['num_comms']} communicator(s)", flush=True)
    result, gates = run_bench(stage, cfg, "result.json")
    stage.add(*[Gate(**g) for g in gates])
    if gpus < 2:
        stage.add(skip("DeepEP test_ep (GPU)", f"{gpus} GPU(s) here: DeepEP's own test_ep needs "
                       "2 or more GPUs; the torch benchmark above is this machine's measurement"))
    return {"result": result, "config": cfg}


def show(stage: Stage, data: dict):
    from lib.glue import glue

    table = bench_result.summary_table(data["result"])
    result = data["result"] or {}
    dc = ((result.get("phases_us") or {}).get("dispatch_combine") or {}).get("p50")
    floor = (result.get("floor_us") or {}).get("p50")
    if dc is not None and floor is not None:
        glue("kernel_dc_p50_us", round(dc, 1), display=False)
        glue("kernel_floor_p50_us", round(floor, 1), display=False)
        glue("kernel_dc_over_floor", round(dc / floor, 2), display=False)
    return table.round(2)
