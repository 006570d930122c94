"""Stage 06: the EP_NUM_COMMS lever, as an interleaved A/B with repeats and a ratio with its CI.

On the local context the lever is the benchmark's --num-comms K (the all-to-all striped over K
process groups): arm A (arm_a_comms) against arm B (arm_b_comms), ab_repeats runs each, in the
order A B, B A, A B, ... so that drift of the machine falls on both arms alike.

With engine 'vllm' the stage is the serving A/B of lib.stages.serving_ab instead (eager against
CUDA graphs, expert parallelism against none), and the EP_NUM_COMMS lever is a SKIP: it needs
DeepEP's GIN, which is off on one machine.
"""
from __future__ import annotations

import pandas as pd

from lib import serve, stats
from lib.evidence import Gate, gate, skip
from lib.stage import Stage
from lib.stages import kernel, serving_ab


def arm_order(repeats: int, a: int, b: int) -> list[tuple[int, int]]:
    """(repeat, comms) pairs, interleaved and alternating which arm goes first."""
    order = []
    for r in range(1, repeats + 1):
        pair = (a, b) if r % 2 else (b, a)
        order += [(r, pair[0]), (r, pair[1])]
    return order


def dc_p50(result: dict | None) -> float | None:
    if not result or not result.get("correct"):
        return None
    return ((result.get("phases_us") or {}).get("dispatch_combine") or {}).get("p50")


def run(stage: Stage) -> dict:
    p = stage.params
    if stage.context != "local":
        stage.add(skip("EP_NUM_COMMS A/B", f"the {stage.context} context's serving A/B "
                       "(vLLM EP_NUM_COMMS 1 vs 8 on the same pods) is not built yet"))
        return {"runs": None}
    if serve.resolve_engine(stage) == "vllm":
        return serving_ab.run(stage)
    gpus = kernel.device_count(stage)
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
    stage.add(skip("serving-level A/B (EP_NUM_COMMS in vLLM)", "the local context serves "
                   "through transformers serve, which has no expert-parallel all-to-all; the "
                   "serving A/B needs DeepEP's ElasticBuffer (kube context)"))
    return {"runs": runs, "ratio": ratio, "a": a, "b": b}


def _verdict(ratio: dict, a: int, b: int) -> str:
    if ratio["high"] < 1:
        return f"K={b} is faster than K={a} here (interval below 1)"
    if ratio["low"] > 1:
        return f"K={b} is slower than K={a} here (interval above 1)"
    return f"no difference between K={a} and K={b} resolved here (interval spans 1)"


def show(stage: Stage, data: dict):
    if data.get("serving_ab"):
        return serving_ab.show(stage, data)
    import matplotlib.pyplot as plt
    from IPython.display import display
    from lib.glue import glue

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
        glue("lever_ratio", round(ratio["ratio"], 3), display=False)
        glue("lever_ratio_low", round(ratio["low"], 3), display=False)
        glue("lever_ratio_high", round(ratio["high"], 3), display=False)
    ax.legend()
    fig.tight_layout()
    fig.savefig(stage.path("ab.png"), dpi=100, metadata={"Software": None}) if not stage.replay else None
    display(fig)
    plt.close(fig)
    return runs.drop(columns=["result"]).round(2)
