"""Stage 06, the levers: interleaved A/Bs with repeats, each ratio with its bootstrap interval.

What it measures depends on what its place serves, and the stage says which in its title and
gates:

- a cluster place (kube, slurm): EP_NUM_COMMS 1 against 8 on the same image and nodes (the
  multicomm overlay; needs DeepEP's GIN over EFA);
- the local place with engine 'transformers' (CPU): the torch benchmark's --num-comms K (the
  all-to-all striped over K process groups), arm A (arm_a_comms) against arm B (arm_b_comms),
  ab_repeats runs each, in the order A B, B A, A B, ... so drift falls on both arms alike;
- the local place with engine 'vllm' (one GPU host): what one host can measure instead, eager
  against CUDA graphs and expert parallelism against none, as a serving A/B (below); the
  EP_NUM_COMMS lever is a SKIP there (it needs DeepEP's GIN, off on one machine).

The serving A/B (also 05's backend A/B, with the backends as arms) is lib.measure.serving's one
loop with several arms:

Three vLLM servers of the same seeded model, started one after another (each takes
lib.serve_vllm.GPU_MEMORY_UTILIZATION of every GPU, so all three fit) and then measured
alternately, so drift of the machine falls on every arm alike; a server idles while another
is measured. Except on DeepEP: two servers that each hold a DeepEP buffer are never up together
(``exclusive_arms``). Then a repeat measures one arm after another (all of an arm's cells in a
block), the arms' order reversed on every other repeat, so drift still falls on every arm alike;
a DeepEP arm's server is started when its block comes and stopped when the other DeepEP arm's
block comes (repeats eager+EP graphs+EP no-EP, no-EP graphs+EP eager+EP, ...: graphs+EP's blocks
of repeats 1 and 2 share one server, eager+EP is started again for repeat 2):

- ``eager+EP``: 04's serve (expert parallelism over the GPUs, the backend asked, --enforce-eager);
- ``graphs+EP``: the same without --enforce-eager (torch.compile and CUDA graphs: the seed
  sample's open question, where its non-eager path measured 239.7 against eager 301.8 tok/s at
  concurrency 64);
- ``eager, no EP``: the same model and DP without --enable-expert-parallel: vLLM 0.24.0 then
  makes every MoE layer tensor-parallel across the DP ranks (each rank a 1/DP slice of every
  expert) and gathers and reduce-scatters the tokens around it (its DP fallback, logged:
  AllGather+ReduceScatter, no expert all-to-all). Measured on 2x H200, not assumed: the first
  recording of this arm showed vLLM does not replicate the experts here.

Per repeat and concurrency one AIPerf cell per arm, the arms' order reversed on every other
repeat. Each ratio (graphs+EP / eager+EP, no EP / eager+EP) of output tokens/s at each concurrency
comes with a paired bootstrap interval (lib.stats). Every number is gated by its server's log (the
backend, the EP split or its absence, eager or graphs) and by vLLM's own token count. A server that
exits by itself during its cells FAILs `server up through its cells`, quoting the first fatal line
of its log; its arm's remaining cells are SKIPs and it is not started again. The
cluster's arms (deepep_v2 against allgather_reducescatter over EFA, EP_NUM_COMMS 1 against 8)
are SKIPs here with their reason.

Throughput says nothing of what an arm computes. So each arm, once its server is up and before
its cells (an exclusive arm: at its first start), is asked lib.agreement's fixed prompts (greedy,
top logprobs; `answer_prompts` of them, 0: none), and each comparison's arm b must answer as
its arm a does: gate `<b> answers as <a>` (a FAIL stands beside the measured numbers).

Artifacts: vllm-<arm>.log per server (vllm-<arm>-<start>.log for a DeepEP arm served one at a
time); aiperf/repeat_<r>/aiperf-<arm>-c<C>/; metrics/...; summary.csv / summary.json (lib.measure.aiperf's
schema, a row per arm x concurrency x repeat); ratios.json; servers.json (the layout, each
server's seconds to ready); answers-<arm>.json (its answers to the fixed prompts);
throughput_ab.png.
"""

from __future__ import annotations

from dataclasses import replace

import pandas as pd

from lib import places
from lib.core.evidence import Gate, gate, skip
from lib.core.stage import Stage
from lib.engines import catalog, server as serve, transport
from lib.measure import stats
from lib.measure.serving import Arm
from lib.places import Unsupported
from lib.roots import pins as pins_mod
from lib.stages import ab, kernel
from lib.stages.refusal import refusals_fail, shows_refusal

BASELINE = Arm("eager+EP", "vllm-eager-ep", True, True)
ARMS = (BASELINE, Arm("graphs+EP", "vllm-graphs-ep", False, True),
        Arm("eager, no EP", "vllm-eager-noep", True, False))
# (arm b, over arm a): each ratio is b / a of output tokens per second
COMPARISONS = (("graphs+EP", "eager+EP"), ("eager, no EP", "eager+EP"))
CLUSTER_ARMS = ("deepep_v2 against allgather_reducescatter over EFA, and EP_NUM_COMMS 1 against 8 "
                "(the multicomm overlay): both need DeepEP's ElasticBuffer with GIN over an RDMA "
                "NIC; this machine has NVLink and no RDMA NIC (GIN off: EP_DISABLE_GIN=1)")


GIN_TYPE5 = "gin_type5"
GIN_LEVER = "GIN type 5 against type 2 (the transport A/B)"


def gin_arm(stage: Stage, place, base: Arm) -> Arm | None:
    """The transport lever's arm on a cluster place: `base` (arm a) served over the other EFA
    contract, so the stage compares GIN type 5 (GPU-initiated, NCCL_GIN_TYPE=5) with type 2 (the
    CPU proxy) on the same nodes and communicators. None, with the lever a SKIP naming the
    floor, where the run's pin set is below type 5's (lib.engines.transport: NCCL >= 2.31,
    EFA installer >= 1.50)."""
    pin_set = stage.params["pin_set"]
    problems = transport.floor_problems(GIN_TYPE5, pins_mod.set_pins(pins_mod.load(), pin_set))
    if problems:
        stage.add(skip(GIN_LEVER, f"pin set {pin_set!r} is below GIN type 5's floor: "
                       f"{'; '.join(problems)}; a pin set that reaches it (-p pin_set) adds "
                       "the arm"))
        return None
    other = "efa" if place.transport == GIN_TYPE5 else GIN_TYPE5
    kind = "5" if other == GIN_TYPE5 else "2"
    return replace(base, name=f"GIN type {kind}, {base.name}", slug=f"{base.slug}-gin{kind}",
                   transport=other)


def arm_order(repeats: int, a: int, b: int) -> list[tuple[int, int]]:
    """(repeat, comms) pairs, interleaved and alternating which arm goes first."""
    return stats.interleaved(repeats, a, b)


def dc_p50(result: dict | None) -> float | None:
    if not result or not result.get("correct"):
        return None
    return ((result.get("phases_us") or {}).get("dispatch_combine") or {}).get("p50")


@refusals_fail
def run(stage: Stage) -> dict:
    p = stage.params
    place = places.for_stage(stage)
    try:
        if serve.resolve_engine(p["engine"]) == "vllm":
            return run_vllm(stage, place)
        gpus = place.gpus()
    except Unsupported as why:
        stage.add(skip("EP_NUM_COMMS A/B", str(why)))
        return {"runs": None}
    a, b = p["arm_a_comms"], p["arm_b_comms"]
    rows, failures, failed_runs = [], [], 0
    for repeat, comms in arm_order(p["ab_repeats"], a, b):
        cfg = kernel.bench_config(stage, gpus, num_comms=comms)
        result, gates = kernel.run_bench(stage, cfg, f"runs/k{comms}_r{repeat}.json")
        value = dc_p50(result)
        print(f"K={comms} repeat {repeat}: D+C p50 "
              f"{'failed' if value is None else f'{value:.1f} us'}", flush=True)
        failed = [g for g in gates if g["status"] == "FAIL"]
        failures += failed
        failed_runs += bool(failed)
        rows.append({"arm": f"K={comms}", "comms": comms, "repeat": repeat, "dc_p50_us": value,
                     "result": f"{stage.rel(stage.path('runs', f'k{comms}_r{repeat}.json'))}"})
    runs = pd.DataFrame(rows)
    stage.write_text("runs.csv", runs.to_csv(index=False))
    evidence = [f"{stage.name}/runs.csv"]
    stage.add(gate("every A/B run exited 0 and was correct", not failures,
                   f"{len(rows) - failed_runs} of {len(rows)}", f"{len(rows)} of {len(rows)}",
                   "; ".join(f"{f['gate']}: {f['reason']}" for f in failures[:3]), evidence))
    ratio = None
    if not failures:
        arm_a = runs[runs.comms == a].sort_values("repeat").dc_p50_us.tolist()
        arm_b = runs[runs.comms == b].sort_values("repeat").dc_p50_us.tolist()
        ratio = stats.paired_ratio(arm_a, arm_b, seed=p["seed"])
        stage.write_json("ratio.json", {"a": f"K={a}", "b": f"K={b}", **ratio})
        stage.add(Gate("D+C p50 ratio K=%d / K=%d with its interval" % (b, a), "PASS",
                       observed=[round(ratio["ratio"], 3), round(ratio["low"], 3),
                                 round(ratio["high"], 3)],
                       expected="ratio, low, high from scipy.stats.bootstrap",
                       reason=_verdict(ratio, a, b), evidence=evidence + [f"{stage.name}/ratio.json"]))
    engine = serve.resolve_engine(p["engine"])
    stage.add(skip("serving-level A/B (EP_NUM_COMMS in vLLM)",
                   f"engine {engine!r}: this lever's serving A/B is wired for vLLM only (06 with "
                   "engine 'vllm'); the kernel-level A/B above is the lever here"
                   if catalog.engine(engine).expert_parallel else
                   f"engine {engine!r} serves without an expert-parallel "
                   "all-to-all; the serving A/B needs vLLM on DeepEP's ElasticBuffer (06 with "
                   "engine 'vllm': on one GPU host its serving A/B, on kube or slurm this lever)"))
    return {"runs": runs, "ratio": ratio, "a": a, "b": b}


def _verdict(ratio: dict, a: int, b: int) -> str:
    return stats.time_ratio_verdict(ratio, f"K={a}", f"K={b}")


@shows_refusal
def show(stage: Stage, data: dict):
    if data.get("serving_ab"):
        return ab.show_serving_ab(stage, data)
    import matplotlib.pyplot as plt
    from IPython.display import display

    runs = data.get("runs")
    if runs is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for arm, cell in runs.groupby("arm", sort=False):
        ax.plot(cell["repeat"], cell["dc_p50_us"], "o-", label=arm)
    ax.set_xlabel("repeat (arms interleaved)")
    ax.set_ylabel("dispatch+combine p50 (us)")
    ratio = data.get("ratio")
    if ratio:
        ax.set_title(f"K={data['b']} / K={data['a']}: {ratio['ratio']:.2f} "
                     f"[{ratio['low']:.2f}, {ratio['high']:.2f}]")
    ax.legend()
    fig.tight_layout()
    fig.savefig(stage.path("ab.png"), dpi=100, metadata={"Software": None}) if not stage.replay else None
    display(fig)
    plt.close(fig)
    return runs.drop(columns=["result"]).round(2)


# ---- the serving A/B (vLLM on one host; 05's backend A/B) -----------------------------------
def run_vllm(stage: Stage, place) -> dict:
    """06 with engine 'vllm'. Where DeepEP's GIN runs (a cluster place): the EP_NUM_COMMS lever,
    arm_a_comms against arm_b_comms on the same image and nodes. On one GPU host: eager vs CUDA
    graphs and EP vs none, the decode shape."""
    p = stage.params
    if place.gin:
        a, b = p["arm_a_comms"], p["arm_b_comms"]
        arms = tuple(Arm(f"EP_NUM_COMMS={k}", f"vllm-epnc{k}", p["enforce_eager"], True,
                         num_comms=k) for k in (a, b))
        comparisons = ((arms[1].name, arms[0].name),)
        gin = gin_arm(stage, place, arms[0])
        if gin is not None:  # type 5 over type 2, both at arm a's communicators
            arms += (gin,)
            comparisons += ((gin.name, arms[0].name) if gin.transport == GIN_TYPE5
                            else (arms[0].name, gin.name),)
        return ab.serving_ab(stage, place, arms, ab.sweep_plan(p, p["ab_repeats"]),
                             comparisons, "throughput_ab.png")
    stage.add(skip("EP_NUM_COMMS A/B (the kernel benchmark's K communicators)",
                   "engine 'vllm' measures the serving A/B; EP_NUM_COMMS is DeepEP's GIN lever, "
                   "off on one machine (EP_DISABLE_GIN=1); the torch analog is 06 with engine "
                   "'transformers'"))
    stage.add(skip("cluster arms", CLUSTER_ARMS))
    return ab.serving_ab(stage, place, ARMS, ab.sweep_plan(p, p["ab_repeats"]),
                         COMPARISONS, "throughput_ab.png")
