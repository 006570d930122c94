"""What 05 and 06 share above the measurement loop: what they read of 04, how an arm is
served on the stage's place, and the serving A/B (05's backend A/B, 06's eager/graphs/EP A/B):
lib.measure.serving's loop with several arms, turned into gates, ratios and a plot.

Not a stage itself: lib/stages' modules 05 (sweep) and 06 (lever) import it; it imports
neither, so the two stages do not import each other.
"""
from __future__ import annotations

from typing import Any, Mapping

from lib.core.evidence import skip
from lib.core.stage import Stage
from lib.measure import serving, sweep
from lib.measure.serving import Arm
from lib.measure.sweep import SweepPlan
from lib.places import ServeSpec, Unsupported

UPSTREAM = "04_serve"
SERVERS_FILE = "servers.json"  # the A/B's server layout and each server's time to ready


def upstream_problem(stage: Stage) -> str | None:
    """Why 04's evidence does not allow measuring (None when it does)."""
    gates = stage.upstream_gates(UPSTREAM)
    if gates is None:
        return f"{UPSTREAM} has no gates in run {stage.run_id}: serve first, then sweep"
    failed = [g["gate"] for g in gates if g["status"] == "FAIL"]
    if failed:
        return f"{UPSTREAM} FAILED in this run ({'; '.join(failed)}): not measured"
    if not any(g["status"] == "PASS" for g in gates):
        return f"{UPSTREAM} passed no gate in this run (all SKIP): not measured"
    return None


def sweep_plan(p: Mapping[str, Any], repeats: int, prefill: bool = False) -> SweepPlan:
    """What every AIPerf cell of a stage is asked, from its parameters `p` (its typed model; in
    a replay, the values its run recorded): the concurrency levels, `repeats` (05's repeats,
    06's ab_repeats), the requests and warmup per cell, the decode shape (input_tokens,
    output_tokens) and with `prefill` the prefill-heavy one (05's backend A/B), the seed and
    AIPerf's prompt corpus."""
    prefill_shape = ((p["prefill_input_tokens"], p["prefill_output_tokens"]) if prefill
                     else None)
    return SweepPlan(concurrency=tuple(p["concurrency"]), repeats=repeats,
                     request_count=p["request_count"],
                     requests_per_slot=p["requests_per_slot"],
                     warmup_requests=p["warmup_requests"],
                     warmup_full_batch=bool(p["warmup_full_batch"]),
                     shapes=serving.shapes_of((p["input_tokens"], p["output_tokens"]),
                                              prefill_shape),
                     seed=p["seed"], prompt_corpus=p["prompt_corpus"])


def arm_servers(stage: Stage, place, model: dict[str, Any], engine: str, gpus: int | None):
    """How the loop serves an arm: the place serves the arm's ServeSpec (its backend, eager or
    graphs, EP or none); `gpus` when the stage asked already (else the place asks)."""
    def serve(arm: Arm, gate_prefix: str, log_name: str | None):
        return place.serve(ServeSpec(
            engine, model, backend=arm.backend or stage["all2all_backend"],
            enforce_eager=arm.enforce_eager, expert_parallel=arm.expert_parallel,
            num_comms=arm.num_comms, transport=arm.transport,
            timeout_s=stage["server_timeout_s"], gate_prefix=gate_prefix, log_name=log_name,
            gpus=gpus, nodes=stage["nodes"]))
    serve.rss = place.server_rss  # what the loop reads of a server's memory
    return serve


# On a cluster place (kube, slurm: not one machine) an arm's serve asks for every GPU of each of
# its nodes, and the run has only those nodes: two arms cannot be up at once (the second's pods
# or step would wait for GPUs the first holds). So there every arm is served alone for its block
# of cells, recreated whole, the blocks' order reversed on every other repeat (06's rounds).


def plan_arms(stage: Stage, serve, arms: tuple[Arm, ...], one_machine: bool) -> dict:
    """A plan of the A/B: each arm's serve rendered and checked in turn, under the names the
    measured loop gives its first start (lib.measure.serving), so a plan lists every arm (06's
    levers among them); one SKIP of the A/B naming each arm's plan."""
    said = []
    for arm in arms:
        one = len(arms) == 1
        first = "" if one_machine else ", start 1"
        prefix = "" if one else arm.name + first
        log = None if one else f"{arm.slug}{'-1' if first else ''}.log"
        try:
            with serve(arm, prefix, log):
                pass
        except Unsupported as why:
            said.append(f"{arm.name}: {why}")
    reason = "; ".join(said) or "a plan measures nothing"
    stage.add(skip("serving A/B", reason))
    return {"serving_ab": True, "skipped": reason, "planned_arms": [a.name for a in arms]}


def backend_arms(backends: list[str]) -> tuple[serving.Arm, ...]:
    """One eager EP arm per all-to-all backend (05's backend A/B)."""
    return tuple(serving.Arm(b, f"vllm-{b.replace('_', '-')}", True, True, b) for b in backends)


def serving_ab(stage: Stage, place, arms: tuple[Arm, ...], plan: SweepPlan,
               comparisons: tuple, plot_name: str) -> dict:
    """Serve every arm on the place (lib.measure.serving's loop), AIPerf cells interleaved over
    the arms for every shape of `plan`; gates, summary, ratios with intervals, one plot."""
    p = stage.params
    shapes, repeats = plan.shapes, plan.repeats
    problem = upstream_problem(stage)
    if problem:
        stage.add(skip("serving A/B", problem))
        return {"serving_ab": True, "skipped": problem}
    try:
        model, built = place.model("vllm")
    except Unsupported as why:
        stage.add(skip("serving A/B", str(why)))
        return {"serving_ab": True, "skipped": str(why)}
    stage.add(built)
    if model is None:
        stage.add(skip("serving A/B", "the model could not be built"))
        return {"serving_ab": True, "skipped": "the model could not be built"}
    def header(layout, order):
        print(f"serving A/B: {layout} on {gpus} GPUs, "
              f"{len(order)} cells ({repeats} repeats x concurrency {p['concurrency']} x "
              f"{len(arms)} arms x {len(shapes)} shape(s)), {plan.requests_said()} requests "
              "each", flush=True)

    if stage.door.planning:  # every arm's serve rendered and checked, nothing measured
        return plan_arms(stage, arm_servers(stage, place, model, "vllm", place.gpus()), arms,
                         place.one_machine)
    try:
        gpus = place.gpus()
        m = serving.measure(stage, arm_servers(stage, place, model, "vllm", gpus), arms, plan,
                            engine="vllm", backend=p["all2all_backend"],
                            answer_prompts=p["answer_prompts"] or 0, header=header,
                            one_at_a_time=not place.one_machine)
    except Unsupported as why:  # a plan: the serves rendered and checked, nothing measured
        stage.add(skip("serving A/B", str(why)))
        return {"serving_ab": True, "skipped": str(why)}
    if m.broken:
        return _not_measured(stage, m)
    stage.add(*serving.died_gates(stage, m))
    frame = serving.summary(stage, m)
    summary_files = sweep.write_summary(stage, frame)
    for shape in shapes:
        for arm in arms:
            stage.add(*serving.exit_gates(m, arm, shape))
            stage.add(*serving.token_gates(m, arm, shape))
    stage.add(*sweep.cell_gates(frame))
    stage.add(sweep.warmup_gate(frame))
    if p["answer_prompts"]:  # does each compared arm compute what its baseline computes?
        stage.add(*serving.answer_gates(m, comparisons))
    ratios = serving.compare(frame, list(plan.concurrency), plan.seed, arms, shapes, comparisons)
    ratio_file = stage.write_json("ratios.json", ratios)
    stage.add(*serving.ratio_gates(ratios, shapes, summary_files + [ratio_file]))
    stage.write_json(SERVERS_FILE, serving.servers_record(stage, m))
    backends = sorted({arm.backend or p["all2all_backend"] for arm in arms})
    title = f"vLLM on {gpus} GPUs, {', '.join(backends)}, {repeats} repeats per arm"
    plot = sweep.save_png(stage, plot_name, serving.plot_arms(frame, title))
    return {"serving_ab": True, "summary": frame, "ratios": ratios, "title": title,
            "plots": [plot], "shapes": [s.__dict__ for s in shapes], "layout": m.layout,
            # an exclusive arm's server may start more than once: the first start, then each
            "startup_s": {arm.name: m.started[arm.slug][0].startup_s for arm in arms},
            "ready_s": {arm.name: m.started[arm.slug][0].ready_s for arm in arms},
            "ready_s_each": {arm.name: [s.ready_s for s in m.started[arm.slug]]
                             for arm in arms}}


def _not_measured(stage: Stage, m: serving.Measurement) -> dict:
    """The A/B's SKIP when a server is not fit to measure: the arms after it wait for nothing."""
    said = []
    for slug, start, problem in m.broken:
        why = ("not ready (see its gate 'server ready')" if not problem.ready else
               f"its log does not prove the serve asked for ({', '.join(problem.failed)})")
        said.append(f"{slug}{'' if start is None else f', start {start}'}: {why}")
    said += [f"{arm.slug}: not started: an earlier arm's server failed" for arm in m.not_started]
    reason = "; ".join(said)
    stage.add(skip("serving A/B", f"not measured: {reason}"))
    return {"serving_ab": True, "skipped": reason}


def show_serving_ab(stage: Stage, data: dict):
    from IPython.display import Image, display

    if data.get("skipped"):
        print(f"not measured: {data['skipped']}")
        return None
    frame = data["summary"]
    display(Image(data=sweep.figure_png(serving.plot_arms(frame, data["title"])), format="png"))
    table = serving.ratio_table(data["ratios"])
    return table
