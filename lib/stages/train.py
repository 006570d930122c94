"""Stage 07: a training step over the same all-to-all: a short Megatron-core run of a small MoE GPT
whose experts are spread over every rank (EP = world), so each step's tokens go through the
dispatcher's all-to-all and back.

The stage's place runs the ranks (lib.places: one torchrun per node, the rendezvous on node 0);
the engine is megatron-core (lib.engines.megatron: its argv, env and the dispatchers it has),
the training lib.bench.moe_train, the gates lib.measure.training's, read from every rank's log.
On the local CPU: two ranks over gloo, EP 2, run twice with the same seed (the determinism gate).
On one GPU: EP 1 (no token crosses a GPU; the gate says so). On a cluster: one rank per GPU
over nodes x GPUs, the EFA write counters before and after as the evidence the wire was used.
"""
from __future__ import annotations

from lib import places
from lib.core.evidence import Gate, skip
from lib.core.stage import Stage
from lib.engines import megatron, transport
from lib.engines.megatron import TrainConfig
from lib.measure import training, triage
from lib.places import RankJob, Unsupported
from lib.stages.refusal import refusals_fail, shows_refusal

TRAIN_TIMEOUT_S = 900  # the CPU run takes about 10 s; a cluster's first NCCL init can take minutes
# What a rank imports of the guide (`python3 -m lib.bench.moe_train`, which imports
# lib.bench.megatron_shims; lib/__init__.py is empty, lib/bench/__init__.py a docstring): the kube
# place ships these to its pods, whose image holds no lib/ (tests/test_guide_modules.py imports
# them with only these files on sys.path).
TRAIN_MODULES = ("lib/__init__.py", "lib/bench/__init__.py", "lib/bench/moe_train.py",
                 "lib/bench/megatron_shims.py")


def train_config(stage: Stage, gpus: int) -> TrainConfig:
    p = stage.params
    on_gpu = gpus >= 1
    return TrainConfig(
        # ranks per node: `ranks` where given (local), else every GPU of the node
        nproc=min(p["ranks"] or gpus, gpus) if on_gpu else (p["ranks"] or 1),
        backend="nccl" if on_gpu else "gloo", steps=p["train_steps"],
        layers=p["train_layers"], hidden=p["train_hidden"], ffn_hidden=p["train_ffn_hidden"],
        heads=p["train_heads"], experts=p["train_experts"], topk=p["train_topk"],
        vocab=p["train_vocab"], seq_len=p["train_seq_len"], micro_batch=p["train_micro_batch"],
        lr=p["train_lr"], dispatcher=p["train_dispatcher"], seed=p["seed"])


def run_training(stage: Stage, cfg: TrainConfig, name: str) -> tuple[dict, list, list[str]]:
    """One training run on the stage's place: every rank's records, the nodes' runs, and the
    evidence files that hold their logs."""
    place = places.for_stage(stage)
    job = RankJob(name, argv=lambda node: megatron.train_argv(
                      cfg, nodes=node.nodes, node_rank=node.rank, master_addr=node.master_addr,
                      port=node.port, python=place.python),
                  env=lambda node: megatron.train_env(node.master_addr),
                  timeout_s=TRAIN_TIMEOUT_S, nodes=stage["nodes"], modules=TRAIN_MODULES)
    runs = place.run_ranks(job)
    streams = list(dict.fromkeys(s for r in runs for s in r.streams))
    ranks = training.parse_ranks("\n".join(r.stdout + "\n" + r.stderr for r in runs))
    return ranks, runs, streams


def exit_gates(runs: list, streams: list[str]) -> list[Gate]:
    """Every node's torchrun exited 0; where one did not, the rank (or node) that failed first."""
    codes = {f"node {r.rank}": (None if r.timed_out else r.rc) for r in runs}
    ok = all(c == 0 for c in codes.values())
    # a node without an exit code: what its place said of it (stopped when a peer failed, never
    # started: the allocation's reason), else that it timed out
    unsaid = [f"node {r.rank}: " + (r.stderr.strip().splitlines()[-1] if r.stderr.strip()
                                    and r.rc is None else "timed out")
              for r in runs if (r.timed_out or r.rc is None)]
    reason = ("" if ok else "a node's torchrun exited non-zero or timed out"
              + (f" ({'; '.join(unsaid)})" if unsaid else ""))
    gates = [Gate("every rank exits 0", "PASS" if ok else "FAIL", codes,
                  "exit code 0 from every node's torchrun (it exits non-zero when any of its "
                  "ranks does)", reason, streams)]
    if not ok:
        gates.append(Gate(**triage.first_failure_gate(
            {f"node {r.rank}": r.stdout + "\n" + r.stderr for r in runs}, codes,
            evidence=streams)))
    return gates


@refusals_fail
def run(stage: Stage) -> dict:
    place = places.for_stage(stage)
    try:
        gpus = place.gpus()
        cfg = train_config(stage, gpus)
        world = cfg.nproc * stage["nodes"]
        print(f"megatron-core {megatron.pinned_version(stage['pin_set'])}: {stage['nodes']} node(s) x "
              f"{cfg.nproc} rank(s) on {cfg.backend}, EP {world}, {cfg.experts} experts top-"
              f"{cfg.topk}, {cfg.steps} steps, dispatcher {cfg.dispatcher}", flush=True)
        ranks, runs, streams = run_training(stage, cfg, "megatron-core training")
        again = None
        if cfg.backend == "gloo" and places.on_one_machine(stage.params):
            # the determinism gate: on this machine's CPU, the same seed twice
            print("again with the same seed (the determinism gate)", flush=True)
            again, again_runs, again_streams = run_training(stage, cfg, "the same run again")
            streams += again_streams
            if any(r.rc != 0 for r in again_runs):
                stage.add(*[Gate(**{**g.as_dict(), "gate": f"the run again: {g.gate}"})
                            for g in exit_gates(again_runs, again_streams)])
    except Unsupported as why:
        stage.add(skip("megatron-core training", str(why)))
        return {"steps": [], "config": None}
    stage.add(*exit_gates(runs, streams))
    stage.add(*training.training_gates(ranks, world=world, steps=cfg.steps,
                                       dispatcher=cfg.dispatcher, evidence=streams, again=again,
                                       efa_expected=transport.over_efa(place.transport)))
    table = training.step_table(ranks)
    stage.write_json("steps.json", table)
    return {"steps": table, "config": cfg.__dict__, "world": world}


@shows_refusal
def show(stage: Stage, data: dict):
    import pandas as pd

    if not data.get("steps"):
        print("not measured: no step was logged (the gates above say why)")
        return None
    table = pd.DataFrame(data["steps"])
    print(f"EP {data['world']}: loss, global grad norm and the token copies every MoE layer's "
          "dispatcher sent to other ranks' experts (forward, all ranks summed) per step:")
    return table.round(4)
