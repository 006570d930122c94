"""Stage 03: the all-to-all works (correctness) and how fast (per-phase p50/p99, beside its floor).

The stage's place runs the processes (lib.places: one per node, rendezvous on node 0). On the
local place: lib.bench.moe_a2a under torchrun, gloo on CPU, NCCL on two or more GPUs. Given a
DeepEP build (``deepep_dir``, with ``nccl_site``) on two or more GPUs, DeepEP's own
tests/elastic/test_ep.py runs too, through lib.engines.deepep's argv/env contract (the
cluster's), at each of ``test_ep_tokens``, with the torch benchmark and its NCCL floor at the
same shape beside it. A place that cannot run ranks says why in one SKIP.

Beside each test_ep D+C stands its transfer bound (lib.measure.bounds) at the stage's shape and
place, and measured / bound: a column, informational, never a gate. A plan runs nothing and
shows the bound alone, for the cluster it plans.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from lib import places
from lib.bench import result as bench_result
from lib.core.evidence import Gate, read_json, skip
from lib.core.stage import Stage
from lib.engines import deepep
from lib.engines import transport as transport_mod
from lib.measure import bounds, testep, triage
from lib.measure.testep import first_case, parse_test_ep_text
from lib.places import NodeRank, RankJob, Unsupported
from lib.stages import transport_ab
from lib.stages.refusal import refusals_fail, shows_refusal

CPU_HIDDEN = 256  # a smaller hidden on CPU keeps the stage in seconds; GPUs use test_ep's 7168
GPU_HIDDEN = 7168
TORCHRUN_TIMEOUT_S = 600
TEST_EP_TIMEOUT_S = 900
BOUND_COLUMN = "D+C bound (us)"
RATIO_COLUMN = "test_ep / bound"


def bench_config(stage: Stage, gpus: int, num_comms: int | None = None) -> dict:
    p = stage.params
    on_gpu = gpus >= 2
    return {
        # ranks per node: `ranks` where given (local), else every GPU of the node
        "nproc": min(p["ranks"] or gpus, gpus) if on_gpu else (p["ranks"] or 1),
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


def torchrun_argv(cfg: dict, node: NodeRank, out: str, python: str = sys.executable) -> list[str]:
    """torchrun of the benchmark on one node; several nodes rendezvous on node 0's port."""
    nodes = ([] if node.nodes == 1 else
             [f"--nnodes={node.nodes}", f"--node-rank={node.rank}"])
    return [
        python, "-m", "torch.distributed.run", f"--nproc-per-node={cfg['nproc']}",
        *nodes, f"--master-addr={node.master_addr}", f"--master-port={node.port}",
        "-m", "lib.bench.moe_a2a",
        "--num-tokens", cfg["num_tokens"], "--hidden", cfg["hidden"], "--num-topk",
        cfg["num_topk"], "--num-experts", cfg["num_experts"], "--num-comms", cfg["num_comms"],
        "--iters", cfg["iters"], "--warmup", cfg["warmup"], "--seed", cfg["seed"],
        "--backend", cfg["backend"], "--out", out,
    ]


def run_bench(stage: Stage, cfg: dict, name: str) -> tuple[dict | None, list[dict]]:
    """One run of the benchmark on the stage's place: its result JSON (None when absent) and
    its gates."""
    out = stage.path(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    job = RankJob("the torch benchmark",
                  argv=lambda node: torchrun_argv(cfg, node, str(out),
                                                  places.for_stage(stage).python),
                  env=lambda node: {"OMP_NUM_THREADS": "1", "MASTER_ADDR": node.master_addr},
                  timeout_s=TORCHRUN_TIMEOUT_S, nodes=stage["nodes"])
    runs = places.for_stage(stage).run_ranks(job)
    # the first node that failed, else node 0 (it writes the result); every node's output kept
    call = next((r for r in runs if r.rc != 0 or r.timed_out), runs[0])
    result = json.loads(out.read_text()) if out.exists() else None
    streams = list(dict.fromkeys(s for r in runs for s in r.streams))
    evidence = ([stage.rel(out)] if out.exists() else []) + streams
    gates = bench_result.gates_from_result(result, call.rc, call.stderr, evidence)
    if len(runs) > 1 and any(r.rc != 0 or r.timed_out for r in runs):  # which node died first
        gates.append(first_failure(runs, streams))
    return result, gates


def first_failure(runs: list, streams: list[str]) -> dict:
    """The gate naming the node (or rank) of a multi-node job that failed first."""
    return triage.first_failure_gate({f"node {r.rank}": r.stdout + "\n" + r.stderr
                                      for r in runs},
                                     {f"node {r.rank}": r.rc for r in runs}, evidence=streams)


@refusals_fail
def run(stage: Stage) -> dict:
    place = places.for_stage(stage)
    try:
        gpus = place.gpus()
        cfg = bench_config(stage, gpus)
        if place.shares_files:  # the benchmark's result JSON lands in the stage folder
            ranks = (f"{cfg['nproc']} ranks" if stage["nodes"] == 1 else
                     f"{stage['nodes']} nodes x {cfg['nproc']} ranks")
            print(f"torchrun: {ranks} on {cfg['backend']}, {cfg['num_tokens']} tokens x "
                  f"hidden {cfg['hidden']}, top-{cfg['num_topk']} of {cfg['num_experts']} "
                  f"experts, {cfg['num_comms']} communicator(s)", flush=True)
            result, gates = run_bench(stage, cfg, "result.json")
            stage.add(*[Gate(**g) for g in gates])
        else:
            result = None
            stage.add(skip("the torch benchmark", f"{place.what}: its result file would not "
                           "come back (no file system shared with this machine); DeepEP's own "
                           "test_ep is the kernel test here"))
    except Unsupported as why:
        stage.add(skip("test_ep via torchrun", str(why)))
        return {"result": None}
    if gpus < 2:
        stage.add(skip("DeepEP test_ep (GPU)", f"{gpus} GPU(s) here: DeepEP's own test_ep needs "
                       "2 or more GPUs; the torch benchmark above is this machine's measurement"))
        return {"result": result, "config": cfg}
    data = {"result": result, "config": cfg}
    if place.deepep_dir():  # on a GPU machine without a DeepEP build: the torch benchmark only
        data["test_ep"] = run_test_ep_beside_bench(stage, cfg, result)
        if stage["transport_ab"]:
            data["transport_ab"] = stage.read_json("transport_ab.json")
        data["bounds"] = transfer_bounds(stage, cfg)
    return data


def transfer_bounds(stage: Stage, cfg: dict) -> dict | None:
    """The transfer bound at each of test_ep's token counts, at the stage's shape (test_ep's
    first case: FP8 dispatch, BF16 combine) and place: nodes x ranks per node on the instance
    type's links (lib/measure/links.yaml; a local run: the local machine's NVLink only).
    Computed, never written as an artifact: test_ep.json holds what was measured, and a
    recorded run replays against it whatever links.yaml says later.

    None for a run whose level says its figures measured no hardware (simulated nodes replaying
    logs recorded elsewhere): a ratio there would compare a place with another machine's
    figures, so none is shown and such a run's outputs stay as recorded. {"why_not": ...} where
    the place or shape is outside the bound's model (more ranks than its link figures cover:
    lib.measure.bounds' ValueError)."""
    record = stage.run_dir / "run.json"
    level = (read_json(record) or {}).get("level") if record.is_file() else None
    if not bounds.is_measurement(level):
        return None
    instance = stage.params.get("instance_type") or bounds.local_instance()
    try:
        return bounds.tokens_bounds(stage["test_ep_tokens"], hidden=cfg["hidden"],
                                    topk=cfg["num_topk"], experts=cfg["num_experts"],
                                    ranks_per_node=cfg["nproc"], nodes=stage["nodes"],
                                    instance=instance)
    except ValueError as why:
        return {"why_not": f"no transfer bound for {stage['nodes']} node(s) x {cfg['nproc']} "
                           f"ranks on {instance}: {why}"}


def beside_bounds(rows: list[dict], bounds_at: dict | None) -> list[dict]:
    """test_ep.json's rows, each with its D+C bound and test_ep / bound (both None where the
    place has no bound); the rows as they are for a run that measured no hardware
    (transfer_bounds None)."""
    if bounds_at is None:
        return rows
    at = {row["tokens"]: row[BOUND_COLUMN] for row in bounds_at.get("rows", [])}
    return [{**row, BOUND_COLUMN: at.get(row["tokens"]),
             RATIO_COLUMN: bounds.ratio(row["test_ep D+C p50 (us)"], at.get(row["tokens"]))}
            for row in rows]


def run_test_ep(stage: Stage, cfg: dict, num_tokens: int, transport: str | None = None,
                tag: str = "") -> tuple[dict | None, list[dict]]:
    """DeepEP's own tests/elastic/test_ep.py at `num_tokens`, correctness on, over `transport`
    or the place's (lib.engines.transport: EFA on a cluster, where the published contract gates
    the p50; NVLink with GIN off on one machine). On one machine test_ep spawns a rank per GPU
    itself (the form the committed 2x H200 runs ran); across nodes torchrun starts one process
    per GPU, each calling test_ep's per-rank entry (lib.engines.deepep.LAUNCHERS: why). `tag`
    names one run of several at the same token count (an A/B arm's repeat)."""
    place = places.for_stage(stage)
    tests_dir = Path(place.deepep_dir()) / "tests" / "elastic"
    launcher = "spawn" if place.one_machine else "torchrun"
    transport_name = transport or place.transport

    def argv(node: NodeRank) -> list[str]:
        return deepep.test_ep_argv(python=place.python, tests_dir=tests_dir,
                                   num_processes=cfg["nproc"], num_tokens=num_tokens,
                                   hidden=cfg["hidden"], num_topk=cfg["num_topk"],
                                   num_experts=cfg["num_experts"], launcher=launcher,
                                   nodes=node.nodes, node_rank=node.rank,
                                   master_addr=node.master_addr, rdzv_port=node.port)

    job = RankJob(f"test_ep at {num_tokens} tokens" + (f", {tag}" if tag else ""), argv=argv,
                  env=lambda node: deepep.test_ep_env(
                      nodes=node.nodes, node_rank=node.rank, master_addr=node.master_addr,
                      rdzv_port=node.port, transport=transport_name,
                      nccl_site=place.nccl_site(),
                      deepep_dir=place.deepep_dir() if place.nccl_site() else None,
                      inherited_pythonpath=os.environ.get("PYTHONPATH"), launcher=launcher),
                  timeout_s=TEST_EP_TIMEOUT_S, nodes=stage["nodes"],
                  modules=deepep.TEST_EP_MODULES if launcher == "torchrun" else (),
                  transport=transport)
    runs = place.run_ranks(job)
    streams = [s for run in runs for s in run.streams]
    text = "\n".join(run.stdout + "\n" + run.stderr for run in runs)
    rc = runs[0].rc if len(runs) == 1 else {f"node {r.rank}": r.rc for r in runs}
    gates = testep.gates_from_test_ep(
        text, None if len(runs) == 1 and runs[0].timed_out else rc,
        num_ranks=cfg["nproc"] * len(runs), evidence=streams, transport=transport_name,
        dc_p50_max_us=(testep.CONTRACT_DC_P50_US if transport_mod.over_efa(transport_name)
                       else None),
        no_exit_said={f"node {r.rank}": r.stderr.strip() for r in runs
                      if r.rc is None and r.stderr.strip()})
    if any(r.rc not in (0, None) or r.timed_out for r in runs) and len(runs) > 1:
        gates.append(first_failure(runs, streams))
    try:
        case = first_case(parse_test_ep_text(text, source=streams[0] if streams else "test_ep"))
    except ValueError:
        case = None
    return case, gates


def run_test_ep_beside_bench(stage: Stage, cfg: dict, result: dict | None) -> list[dict]:
    """Per token count: test_ep, then the torch benchmark and its floor at the same shape (the
    run at cfg's own token count is reused). Gates prefixed 'test_ep <T> tokens: '."""
    rows, ab_results = [], []
    shares_files = places.for_stage(stage).shares_files
    for tokens in stage["test_ep_tokens"]:
        if stage["transport_ab"]:  # both EFA contracts, interleaved: each arm's median beside
            ab = transport_ab.run_ab(stage, cfg, tokens, run_test_ep)
            ab_results += [ab] if ab else []
            case = {"dc_p50_us": transport_ab.arm_median(ab, places.for_stage(stage).transport)}
        else:
            try:
                case, gates = run_test_ep(stage, cfg, tokens)
            except Unsupported as why:  # a plan: rendered and checked, not run
                case, gates = None, [skip("test_ep run", str(why)).as_dict()]
            stage.add(*[Gate(**{**g, "gate": f"test_ep {tokens} tokens: {g['gate']}"})
                        for g in gates])
        if tokens == cfg["num_tokens"] or not shares_files:
            bench = result
        else:
            bench, bench_gates = run_bench(stage, {**cfg, "num_tokens": tokens},
                                           f"result_{tokens}.json")
            stage.add(*[Gate(**{**g, "gate": f"torch benchmark {tokens} tokens: {g['gate']}"})
                        for g in bench_gates])
        dc = ((bench or {}).get("phases_us") or {}).get("dispatch_combine") or {}
        rows.append({"tokens": tokens,
                     "test_ep D+C p50 (us)": (case or {}).get("dc_p50_us"),
                     "torch D+C p50 (us)": dc.get("p50"),
                     "NCCL floor p50 (us)": ((bench or {}).get("floor_us") or {}).get("p50")})
    stage.write_json("test_ep.json", rows)
    if stage["transport_ab"]:
        stage.write_json("transport_ab.json", ab_results)
    return rows


@shows_refusal
def show(stage: Stage, data: dict):
    if data.get("test_ep"):
        import pandas as pd
        from IPython.display import display

        table = pd.DataFrame(beside_bounds(data["test_ep"], data.get("bounds")))
        beside = ("the torch benchmark, the bare NCCL floor and its transfer bound"
                  if BOUND_COLUMN in table else "the torch benchmark and the bare NCCL floor")
        print(f"DeepEP test_ep (first case: FP8 dispatch, bf16 combine) beside {beside}, per "
              "token count:")
        display(table.round({c: 2 if c == RATIO_COLUMN else 1 for c in table.columns}))
        if data.get("bounds"):
            show_bounds(data["bounds"], table, stage.run_id)
        if data.get("transport_ab"):
            show_transport_ab(data["transport_ab"])
    table = bench_result.summary_table(data["result"])
    return table.round(2)


def show_transport_ab(results: list[dict]) -> None:
    """The transport A/B: per token count each arm's median D+C p50 and type 5 / type 2."""
    import pandas as pd
    from IPython.display import display

    runs = sum(len(r["runs"]) for r in results)
    print(f"Transport A/B ({runs} test_ep runs, the arms interleaved): D+C p50 over GIN type 2 "
          "(CPU proxy) and GIN type 5 (GPU-initiated), the median of each arm's repeats, and "
          "type 5 / type 2 with its paired bootstrap interval:")
    display(pd.DataFrame(transport_ab.table_rows(results)).round(3))


def show_bounds(bounds_at: dict, table, run_id: str) -> None:
    """The bound per phase at the stage's place, what it is (computed, not measured), its link
    sources, and where test_ep ran how the ratio reads."""
    import pandas as pd
    from IPython.display import display

    if "why_not" in bounds_at:
        print(f"Transfer bound: {bounds_at['why_not']}")
        return
    ran = table["test_ep D+C p50 (us)"].notna().any()
    print(f"Transfer bound (lib.measure.bounds: a bound, not a measurement) for "
          f"{bounds.describe_place(bounds_at)}, per token count:")
    display(pd.DataFrame(bounds_at["rows"]).round(1))
    for line in bounds_at["sources"]:
        print(line)
    if bounds_at["fitted_on"]:
        mine = any(Path(run).name == run_id for run in bounds_at["fitted_on"])
        print("  NVLink latency fitted on: " + ", ".join(bounds_at["fitted_on"]) + (
            " (this run: its ratios are not an independent check)" if mine else ""))
    print("test_ep / bound: how far from the wire test_ep ran (>= 1 where the bound holds; "
          "informational, never a gate; what the bound leaves out: lib/measure/BOUNDS.md)."
          if ran else "Nothing ran here: the bound is what 'close to the wire' would be at this "
          "place, before any GPU hour is spent.")
