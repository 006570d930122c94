"""The figures behind the results page, gathered across every run that may feed them.

Each function reads evidence files only (through the catalog) and returns a flat table: one row
per plotted or tabulated number, naming its run, so a page or a plot can cite each number's
evidence. A run feeds these tables only if the catalog says it may (real GPUs, the place it
names, its seal intact), and a stage's numbers only if that stage has no FAIL gate; otherwise
the number is absent, and the page says "not measured" with the reason.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd

from lib.core import evidence
from lib.engines import vllm_logs
from lib.measure import bounds, published, serving
from lib.measure.stats import MIN_ROUNDS_FOR_INTERVAL
from lib.publish.catalog import REFERENCE_FILE, Run, host_facts

KERNEL_SERIES = {  # test_ep.json's columns -> the series a reader sees
    "test_ep D+C p50 (us)": "DeepEP test_ep",
    "torch D+C p50 (us)": "torch benchmark",
    "NCCL floor p50 (us)": "NCCL floor (two all_to_all_single)",
}
SERVING_STAGES = ("05_sweep", "06_multicomm")
LATENCIES = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def kernel_points(runs: list[Run]) -> pd.DataFrame:
    """dispatch+combine p50 against tokens per rank, per series, from every run whose 03 passed."""
    rows = []
    for run in runs:
        if not run.feeds_results or run.stages.get("03_kernel_test") != "PASS":
            continue
        stage = run.path / "03_kernel_test"
        if (stage / "test_ep.json").exists():
            for row in evidence.read_json(stage / "test_ep.json"):
                for column, series in KERNEL_SERIES.items():
                    rows.append({"run": run.run_id, "series": series, "tokens": row["tokens"],
                                 "p50_us": row[column], "hardware": run.hardware})
        elif (stage / "result.json").exists():  # the torch benchmark alone, at its one shape
            result = evidence.read_json(stage / "result.json")
            tokens = result.get("config", {}).get("num_tokens")
            dc = (result.get("phases_us") or {}).get("dispatch_combine") or {}
            if result.get("correct") and dc.get("p50") is not None:
                rows.append({"run": run.run_id, "series": "torch benchmark", "tokens": tokens,
                             "p50_us": dc["p50"], "hardware": run.hardware})
                rows.append({"run": run.run_id, "series": KERNEL_SERIES["NCCL floor p50 (us)"],
                             "tokens": tokens, "p50_us": result["floor_us"]["p50"],
                             "hardware": run.hardware})
    return pd.DataFrame(rows, columns=["run", "series", "tokens", "p50_us", "hardware"])


def published_kernel_point() -> dict:
    """The public reproduction's test_ep dispatch+combine p50: the same kernels and shape, other
    hardware (EP16 across two p5en nodes over EFA)."""
    table = published.reference_figures().set_index("figure")
    row = table.loc["test_ep D+C p50"]
    return {"series": "DeepEP test_ep, 2x p5en over EFA (cited)", "tokens":
            published.MICROBENCH_TOKENS, "p50_us": float(row["value"]),
            "hardware": row["hardware"], "date": row["date"], "source": row["source"]}


def _vllm_served(run: Run) -> bool:
    return run.feeds_results and (run.path / "04_serve" / "vllm_serve.json").exists()


# What a serving figure needs to say beside each number: how many GPUs one server spans (output
# tok/s is read per GPU), where, which engine, and what each arm and traffic shape is.
# `comparison`, by which the plots group their figures: "backends" (05's backend A/B), "sweep"
# (05's one arm) or "levers" (06's arms, lib.stages.lever.ARMS); `arm_order` 0 is the arm the
# others are compared with (a of each b / a).
SERVING_FACTS = ["gpus", "place", "engine", "date", "comparison", "backend", "arm_label",
                 "arm_order", "shape", "shape_said"]
NO_EP = "none (no EP)"  # an arm without expert parallelism builds no all-to-all of any backend
_VERSION_LINE = re.compile(r"\bversion (\d+\.\d+\.\d+\S*)")


def serving_gpus(run: Run) -> int | None:
    """GPUs one vLLM server of the run spans: 04's vllm_serve.json `gpus` (DP = EP over every
    node of the place; 05's and 06's arm servers are started on the same place, lib.stages.ab),
    else the run's host GPUs times its nodes; None where neither was recorded."""
    served = evidence.read_json(run.path / "04_serve" / "vllm_serve.json")
    if served.get("gpus"):
        return int(served["gpus"])
    gpus = len(host_facts(run.path).get("gpus") or [])
    nodes = (run.record.get("parameters") or {}).get("nodes") or 1
    return gpus * int(nodes) or None


def place_said(run: Run, gpus: int | None) -> str:
    """'2x H200': the GPUs one server spans and their model, from the run's host facts."""
    names = sorted({str(g.get("name", "GPU")).replace("NVIDIA ", "")
                    for g in host_facts(run.path).get("gpus") or []})
    if not names:
        return run.hardware
    return f"{gpus or '?'}x {' + '.join(names)}"


def engine_said(run: Run, stage: str) -> str:
    """'vLLM 0.24.0': the version vLLM's start-up banner printed in the stage's first server log
    (else 04's); 'vLLM' where no log says it."""
    logs = sorted((run.path / stage).glob("vllm*.log")) + [run.path / "04_serve" / "vllm.log"]
    for log in logs:
        if not log.exists():
            continue
        with log.open(encoding="utf-8", errors="replace") as fh:
            head = fh.read(200_000)  # the banner comes in the first lines
        found = _VERSION_LINE.search(head)
        if found:
            return f"vLLM {found.group(1)}"
    return "vLLM"


def serving_arms(run: Run, stage: str) -> dict[str, dict]:
    """summary.csv's arm -> what it is: its label as the gates say it, its all-to-all backend,
    its traffic shape (lib.measure.serving.traffic_shapes) and the stage's comparison. An arm no
    stage knows keeps its own name."""
    from lib.stages import ab, lever

    path = run.path / stage / "params.json"
    params = evidence.read_json(path) if path.exists() else {}
    backend = params.get("all2all_backend", "")
    if stage == "06_multicomm":
        comparison, arms = "levers", lever.ARMS
    elif params.get("ab_backends"):
        comparison, arms = "backends", ab.backend_arms(params["ab_backends"])
    else:
        comparison = "sweep"
        arms = (serving.Arm(backend or params.get("engine", "vllm"), params.get("engine", "vllm")),)
    try:
        shapes = serving.traffic_shapes(params, prefill=comparison == "backends")
    except KeyError:  # a stage recorded before its shape was a parameter
        shapes = ()
    facts = {}
    for order, arm in enumerate(arms):  # order 0: the arm the others are compared with (a)
        for shape in shapes or (None,):
            name = arm.slug if shape is None else serving.cell_arm(arm, shape, shapes)
            facts[name] = {
                "comparison": comparison, "arm_label": arm.name, "arm_order": order,
                "backend": (arm.backend or backend) if arm.expert_parallel else NO_EP,
                "shape": shape.name if shape and len(shapes) > 1 else "",
                "shape_said": (f"{shape.name}: {shape.input_tokens} tokens in, "
                               f"{shape.output_tokens} out" if shape else "")}
    return facts


def serving_cells(runs: list[Run]) -> pd.DataFrame:
    """Every AIPerf cell of every vLLM run (05 and 06), with whether it may be plotted and
    SERVING_FACTS (the GPUs one server spans, place, engine, what the arm is)."""
    frames = []
    for run in runs:
        if not _vllm_served(run):
            continue
        gpus = serving_gpus(run)
        for stage in SERVING_STAGES:
            path = run.path / stage / "summary.csv"
            if not path.exists():
                continue
            cells = pd.read_csv(path)
            cells.insert(0, "stage", stage)
            cells.insert(0, "run", run.run_id)
            complete = (cells["requests_completed"] == cells["requests_requested"]) \
                & (cells["errors"] == 0) & cells["output_tps"].notna()
            cells["measured"] = complete
            arms = serving_arms(run, stage)
            fallback = {"comparison": "sweep", "backend": "", "shape": "", "shape_said": "",
                        "arm_order": 0}
            for column in ("comparison", "backend", "arm_label", "arm_order", "shape",
                           "shape_said"):
                cells[column] = [arms.get(arm, {**fallback, "arm_label": arm})[column]
                                 for arm in cells["arm"]]
            cells["gpus"] = gpus
            cells["place"] = place_said(run, gpus)
            cells["engine"] = engine_said(run, stage)
            cells["date"] = run.date
            frames.append(cells)
    if not frames:
        return pd.DataFrame(columns=["run", "stage", "arm", "concurrency", "repeat",
                                     "output_tps", "measured", *LATENCIES, *SERVING_FACTS])
    return pd.concat(frames, ignore_index=True)


def serving_points(cells: pd.DataFrame) -> pd.DataFrame:
    """Per run, stage, arm and concurrency: output tok/s median with the repeats' spread, the
    same per GPU (divided by the GPUs one server spans), and the latency percentiles' medians,
    over the measured cells only; with SERVING_FACTS."""
    measured = cells[cells["measured"]]
    per_gpu = ["output_tps_per_gpu", "output_tps_per_gpu_min", "output_tps_per_gpu_max"]
    if measured.empty:
        return pd.DataFrame(columns=["run", "stage", "arm", "concurrency", "repeats",
                                     "output_tps", "output_tps_min", "output_tps_max",
                                     *LATENCIES, *SERVING_FACTS, *per_gpu])
    keys = ["run", "stage", "arm", "concurrency"]
    grouped = measured.groupby(keys)
    points = grouped["output_tps"].agg(["median", "min", "max", "count"]).rename(columns={
        "median": "output_tps", "min": "output_tps_min", "max": "output_tps_max",
        "count": "repeats"})
    points = points.join(grouped[list(LATENCIES)].median())
    facts = [c for c in SERVING_FACTS if c in measured]
    points = points.join(grouped[facts].first()).reset_index()
    if "gpus" in points:
        gpus = pd.to_numeric(points["gpus"], errors="coerce")
        for total, each in zip(("output_tps", "output_tps_min", "output_tps_max"), per_gpu):
            points[each] = points[total] / gpus
    return points


LEVER_COLUMNS = ["run", "stage", "lever", "shape", "concurrency", "rounds", "ratio", "low",
                 "high", "each_round", "a_tps", "b_tps", "why_not", "comparison", "backend", "place", "engine",
                 "date"]


def lever_ratios(runs: list[Run]) -> pd.DataFrame:
    """Every A/B ratio (05's backend A/B, 06's levers) of every run that may feed results, with
    each paired round's own ratio; an interval only from MIN_ROUNDS_FOR_INTERVAL rounds; and
    what the plot says beside it: the stage's comparison and all-to-all backend, the place (the
    GPUs one server spans), the engine and the run's date."""
    rows = []
    for run in runs:
        if not _vllm_served(run):
            continue
        gpus = serving_gpus(run)
        for stage in SERVING_STAGES:
            path = run.path / stage / "ratios.json"
            if not path.exists():
                continue
            params_path = run.path / stage / "params.json"
            params = evidence.read_json(params_path) if params_path.exists() else {}
            facts = {"comparison": "levers" if stage == "06_multicomm" else "backends",
                     "backend": params.get("all2all_backend", ""),
                     "place": place_said(run, gpus), "engine": engine_said(run, stage),
                     "date": run.date}
            for r in evidence.read_json(path):
                a, b = r.get("a_tps") or [], r.get("b_tps") or []
                rounds = [y / x for x, y in zip(a, b) if x]
                with_interval = r["ratio"] is not None and r["n"] >= MIN_ROUNDS_FOR_INTERVAL
                rows.append({
                    "run": run.run_id, "stage": stage, "lever": f"{r['b']} / {r['a']}",
                    "shape": r.get("shape", ""), "concurrency": r["concurrency"],
                    "rounds": r["n"], "ratio": r["ratio"],
                    "low": r["low"] if with_interval else None,
                    "high": r["high"] if with_interval else None,
                    "each_round": rounds, "a_tps": list(a), "b_tps": list(b),
                    "why_not": "" if r["ratio"] is not None else not_measured_reason(
                        run.path / stage, r["b"]), **facts})
    return pd.DataFrame(rows, columns=LEVER_COLUMNS)


def not_measured_reason(stage_dir: Path, arm: str) -> str:
    """Why an arm has no figure: where its server's log says why it died, that line and the
    step it was running; else the first FAIL gate that names the arm, else the stage's first."""
    slug = arm.lower().replace("+", "-").replace(", ", "-").replace(" ", "-")
    for log in sorted(stage_dir.glob(f"vllm-{slug}*.log")):
        text = log.read_text(encoding="utf-8", errors="replace")
        fatal = vllm_logs.first_fatal_line(text, log_name=log.name)
        if fatal:
            step = vllm_logs.crashed_step(text, log_name=log.name)
            return (f"the server died serving: {fatal[:200]}"
                    + (f"; {vllm_logs.describe_step(step)}" if step else ""))
    failed = [g for g in evidence.read_gates(stage_dir) or [] if g["status"] == "FAIL"]
    named = [g for g in failed if arm in g["gate"] or slug in g["gate"]]
    first = (named or failed or [None])[0]
    if first is None:
        return "no paired round completed"
    reason = " ".join(evidence.without_terminal_codes(first["reason"]).split())
    return f"{first['gate']}: {reason[:200]}"


# ---- how close to the wire: every figure beside its transfer bound (lib.measure.bounds) --------
BOUND_EPS = (8, 16, 32, 64)  # the plot's bound lines: 1, 2, 4 and 8 nodes of 8 GPUs
BOUND_COLUMNS = ["figure", "run", "kind", "instance", "nodes", "ranks_per_node", "tokens",
                 "dispatch_dtype", "phase", "bound_us", "measured_us", "ratio", "fitted_on",
                 "source", "date", "level"]


def cluster_shape() -> dict:
    """The shape 03 runs test_ep at on a cluster (the registry's plan defaults): the bound
    lines' shape, instance and token counts."""
    from lib.stages import registry

    p = registry.resolve("03_kernel_test", {"context": "plan"})
    return {"hidden": p["hidden"], "topk": p["num_topk"], "experts": p["num_experts"],
            "tokens": list(p["test_ep_tokens"]), "instance": p["instance_type"],
            "ranks_per_node": p["gpus_per_node"]}


def _run_instance(run: Run) -> tuple[str, int]:
    params = run.record.get("parameters") or {}
    return (params.get("instance_type") or bounds.local_instance(), params.get("nodes") or 1)


def bound_rows(runs: list[Run]) -> pd.DataFrame:
    """Every figure beside its bound, one row per phase measured (dispatch, combine, dc): the
    guide's own test_ep first cases, read at build time from the logs of every run that may
    feed results and whose 03 passed with test_ep, then every cited figure
    (lib/measure/cited_figures.yaml). ratio = measured / bound."""
    rows = []
    for run in runs:
        if not (run.feeds_results and run.stages.get("03_kernel_test") == "PASS"
                and (run.path / "03_kernel_test" / "test_ep.json").exists()):
            continue
        instance, nodes = _run_instance(run)
        for row in bounds.run_rows(run.path, instance, run.date, f"test_ep on {run.hardware}",
                                   nodes=nodes):
            rows.append({**row, "figure": f"test_ep {row['tokens']} tokens", "run": run.run_id,
                         "level": run.level})
    for row in bounds.cited_rows():
        rows.append({**row, "run": "", "level": "cited"})
    return pd.DataFrame(rows, columns=BOUND_COLUMNS)


def _dc_points(table: pd.DataFrame) -> pd.DataFrame:
    """One D+C point per figure: its dc row, else its dispatch + combine (both measured)."""
    points = []
    keys = ["figure", "run", "kind", "instance", "nodes", "ranks_per_node", "tokens",
            "dispatch_dtype"]
    for key, rows in table.groupby(keys, sort=False):
        by_phase = rows.set_index("phase")
        if "dc" in by_phase.index:
            measured = by_phase.loc["dc", "measured_us"]
        elif {"dispatch", "combine"} <= set(by_phase.index):
            measured = by_phase.loc["dispatch", "measured_us"] + by_phase.loc["combine",
                                                                            "measured_us"]
        else:
            continue
        points.append({**dict(zip(keys, key)), "measured_us": float(measured)})
    return pd.DataFrame(points, columns=[*keys, "measured_us"])


def _place_label(ep: int, instance: str, nodes: int, dtype: str) -> str:
    return f"EP {ep}: {nodes} x {instance}" + ("" if dtype == "fp8" else f", {dtype} dispatch")


def bound_lines(points: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The D+C bound across tokens (powers of two from the stage's least test_ep token count to
    the most of its own and of any point) for EP 8, 16, 32 and 64 on the cluster's instance,
    and for each other place a point was measured at; and the points, each naming its line.
    Each line says what bounds it (`basis`: bounds.link_label, e.g. NCCL's all_to_all_single
    floor measured here, or the EFA NICs' specification) and is `kind` "bound" (the bound every
    ratio is taken against); where a place's NVLink figure is a measured curve and a point was
    measured there, a `kind` "wire" line beside it: the same bytes over the link's specification
    (bounds.wire_nvlink; links.yaml gives it no fixed cost), never a ratio's denominator."""
    shape = cluster_shape()
    most = max([*shape["tokens"], *points["tokens"]]) if len(points) else max(shape["tokens"])
    grid = [2 ** k for k in range(int(math.log2(min(shape["tokens"]))),
                                  int(math.ceil(math.log2(most))) + 1)]
    places = {(shape["ranks_per_node"] * (ep // shape["ranks_per_node"]), shape["instance"],
               ep // shape["ranks_per_node"], shape["ranks_per_node"], "fp8")
              for ep in BOUND_EPS}
    points = points.assign(line=[
        _place_label(int(p.nodes * p.ranks_per_node), p.instance, int(p.nodes), p.dispatch_dtype)
        for p in points.itertuples()])
    measured_at = set()
    for p in points.itertuples():
        place = (int(p.nodes * p.ranks_per_node), p.instance, int(p.nodes), int(p.ranks_per_node),
                 p.dispatch_dtype)
        places.add(place)
        measured_at.add(place)
    lines = []
    for ep, instance, nodes, per_node, dtype in sorted(places):
        wire = bounds.wire_nvlink(instance) if (
            nodes == 1 and (ep, instance, nodes, per_node, dtype) in measured_at) else None
        for kind, nvlink in (("bound", None), ("wire", wire)):
            if kind == "wire" and wire is None:
                continue
            answer = bounds.tokens_bounds(grid, hidden=shape["hidden"], topk=shape["topk"],
                                          experts=shape["experts"], ranks_per_node=per_node,
                                          nodes=nodes, instance=instance, dispatch_dtype=dtype,
                                          nvlink=nvlink)
            lines += [{"line": _place_label(ep, instance, nodes, dtype), "ep": ep,
                       "instance": instance, "nodes": nodes, "kind": kind,
                       "basis": answer["label"],
                       "cluster": kind == "bound" and (instance, per_node, dtype) == (
                           shape["instance"], shape["ranks_per_node"], "fp8"),
                       "tokens": row["tokens"], "bound_us": row["D+C bound (us)"]}
                      for row in answer["rows"]]
    return pd.DataFrame(lines), points


# ---- a training step over the all-to-all (stage 07) ---------------------------------------------
TRAIN_STAGE = "07_train"
CPU_TRAINING = "measured here, CPU, tiny model"
TRAINING_COLUMNS = ["run", "hardware", "ep", "steps", "first_loss", "last_loss", "crossing_min",
                    "crossing_max", "level", "state", "failed_gates"]


def _is_reference(run: Run) -> bool:
    listing = run.path.parent / REFERENCE_FILE
    return listing.exists() and listing.read_text(encoding="utf-8").strip() == run.run_id


def training_level(run: Run) -> str | None:
    """The level a run's 07 is shown at, or None where it is not shown. A run that may feed
    results (real GPUs, seal intact) is shown at its own level, its FAIL as a FAIL; the CPU
    reference run (the one re-recorded with every change to a stage, every process real, a tiny
    model over gloo) at CPU_TRAINING, for the shape of its curve, never as a figure; no other
    CPU, simulated or planned run (the appendix lists them). 07 must have run (PASS or FAIL)."""
    if run.stages.get(TRAIN_STAGE) not in ("PASS", "FAIL"):
        return None
    if run.feeds_results:
        return run.level
    cpu_reference = (_is_reference(run) and run.context == "local" and not run.record.get("level")
                     and not host_facts(run.path).get("gpus")
                     and not run.seal.startswith("tampered"))
    return CPU_TRAINING if cpu_reference else None


def _train_steps(run: Run) -> list[dict]:
    path = run.path / TRAIN_STAGE / "steps.json"
    return evidence.read_json(path) if path.exists() else []


def training_ep(run: Run) -> int | None:
    """EP of a run's 07: the ranks that logged its steps (the stage spreads the experts over
    every rank, EP = world), from its steps.json; None where no step was logged."""
    steps = _train_steps(run)
    return max(int(s["ranks"]) for s in steps) if steps else None


def training_steps(runs: list[Run]) -> pd.DataFrame:
    """One row per step of every run whose 07 is shown (training_level): loss, grad norm, the
    token copies sent to other ranks' experts (all ranks summed), its level, 07's state and the
    run's hardware."""
    rows = []
    for run in runs:
        level = training_level(run)
        if level is None:
            continue
        for s in _train_steps(run):
            rows.append({"run": run.run_id, "step": int(s["step"]), "loss": float(s["loss"]),
                         "grad_norm": float(s["grad norm"]),
                         "crossing": int(s["sent to other ranks"]), "ranks": int(s["ranks"]),
                         "level": level, "state": run.stages[TRAIN_STAGE],
                         "hardware": run.hardware})
    return pd.DataFrame(rows, columns=["run", "step", "loss", "grad_norm", "crossing", "ranks",
                                       "level", "state", "hardware"])


def training_summary(runs: list[Run]) -> pd.DataFrame:
    """One row per run whose 07 is shown: hardware, EP, steps, first and last loss, the least
    and most token copies crossing ranks in a step, level, 07's state and its FAIL gates (by
    name, from its gates.json); None for a figure no step logged."""
    rows = []
    for run in runs:
        level = training_level(run)
        if level is None:
            continue
        steps = sorted(_train_steps(run), key=lambda s: s["step"])
        crossing = [int(s["sent to other ranks"]) for s in steps]
        failed = [g["gate"] for g in evidence.read_gates(run.path / TRAIN_STAGE) or []
                  if g["status"] == "FAIL"]
        rows.append({"run": run.run_id, "hardware": run.hardware, "ep": training_ep(run),
                     "steps": len(steps),
                     "first_loss": float(steps[0]["loss"]) if steps else None,
                     "last_loss": float(steps[-1]["loss"]) if steps else None,
                     "crossing_min": min(crossing) if crossing else None,
                     "crossing_max": max(crossing) if crossing else None,
                     "level": level, "state": run.stages[TRAIN_STAGE], "failed_gates": failed})
    return pd.DataFrame(rows, columns=TRAINING_COLUMNS)
