"""Published reference figures and a comparison of a run against them.

The figures are those of the public 2x p5en reproduction (ANCHORS.md section 3, "Every number in
RESULTS.md"), as published, at their published precision (``decimals``). Note that RESULTS.md
rounds the hand-written summary JSONs' already-rounded values, so a figure can sit one unit of
its last digit away from a single rounding of the raw export (474.49 ms -> 474.5 -> 475;
9.9467 tok/s -> 9.95 -> 10.0).

Figure names are ``test_ep <phase> p50`` for the microbenchmark and
``vllm <arm> c<concurrency> <metric>`` for serving cells, where ``<metric>`` is a column of the
AIPerf summary schema (``lib.measure.aiperf.SUMMARY_COLUMNS``).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import pandas as pd

SOURCE = "antonai-work/deepep-v2-efa-repro RESULTS.md"
# SOURCE in lib/publish/sources.yaml: its URL at the commit the figures were read at. The book
# links every "cited: <SOURCE>" through lib.publish.sources.link_references.
SOURCE_ID = "repro-results"
HARDWARE = "2x p5en.48xlarge (16x H200), EP16 across 2 nodes over EFA"
TOLERANCE = 0.10  # the anchors' stated run-to-run variance is ~10%
REFERENCE_COLUMNS = ("figure", "value", "unit", "decimals", "hardware", "date", "source")
SERVING_METRICS = {
    "output_tps": ("tokens/s", 1),
    "output_tps_per_user": ("tokens/s/user", 1),
    "ttft_p50_ms": ("ms", 0),
    "itl_p50_ms": ("ms", 0),
}
_CONCURRENCIES = (4, 8, 32)
# ANCHORS.md section 3, per arm and metric, at concurrency 4 / 8 / 32.
_SERVING = {
    "epnc1": {"output_tps": (19.5, 38.8, 144.6), "output_tps_per_user": (4.9, 4.9, 4.7),
              "ttft_p50_ms": (475, 510, 899), "itl_p50_ms": (203, 203, 206)},
    "epnc8": {"output_tps": (39.4, 76.5, 273.0), "output_tps_per_user": (10.0, 9.7, 8.9),
              "ttft_p50_ms": (196, 237, 280), "itl_p50_ms": (100, 103, 106)},
}
# ANCHORS.md section 3, gates 2 to 4 ("Every number in RESULTS.md"): every engine served the same
# model (Qwen/Qwen3-30B-A3B-FP8) with the same AIPerf workload (completions, ISL 120 / OSL 128,
# ignore_eos, 40 / 64 / 128 requests at c4 / c8 / c32) on the same 2x p5en, one run per arm; each
# on its own stack, so the rows differ in more than the engine. vLLM's rows are _SERVING's own.
# SGLang's arm ran with the EP_NUM_COMMS 8 overlay too (its serve script's default, ANCHORS.md
# 1.6); what TensorRT-LLM's arms set for it, the source does not say.
CROSS_ENGINE_DATE = "2026-07-07"
_CROSS_ENGINE = (
    ("vllm", "vLLM 0.24.0, EP_NUM_COMMS 1", _SERVING["epnc1"]["output_tps"]),
    ("vllm", "vLLM 0.24.0, EP_NUM_COMMS 8 (the multicomm overlay)",
     _SERVING["epnc8"]["output_tps"]),
    ("sglang", "SGLang 0.5.11 with a seam patch, EP_NUM_COMMS 8 (the overlay)",
     (34.5, 67.2, 255.2)),
    ("trtllm", "TensorRT-LLM 0.21.0 through an API shim", (66.5, 147.5, 586.7)),
    ("trtllm", "TensorRT-LLM 0.21.0 through a one-file native seam", (67.6, 142.4, 563.3)),
)
CROSS_ENGINE_WORKLOAD = ("Qwen/Qwen3-30B-A3B-FP8, AIPerf completions, ISL 120 / OSL 128, "
                         "ignore_eos, one run per arm")
_MICROBENCH = (("test_ep dispatch p50", 185.4), ("test_ep combine p50", 258.2),
               ("test_ep D+C p50", 443.6))
# The published test_ep ran at 128 tokens per rank (ANCHORS.md section 1, the torchrun wrapper's
# namespace: num_tokens=128 hidden=7168 num_topk=8 num_experts=256).
MICROBENCH_TOKENS = 128
# lib.stages.kernel names each DeepEP test_ep gate "test_ep <tokens> tokens: <gate>".
_TEST_EP_DC_GATE = "test_ep {tokens} tokens: dispatch+combine p50 recorded"


def serving_figure_name(arm: str, concurrency: int, metric: str) -> str:
    return f"vllm {arm} c{int(concurrency)} {metric}"


def reference_figures() -> pd.DataFrame:
    """The published figures: figure, value, unit, decimals, hardware, date, source."""
    rows = [{"figure": name, "value": value, "unit": "us", "decimals": 1, "hardware": HARDWARE,
             "date": "2026-07-06", "source": SOURCE} for name, value in _MICROBENCH]
    for arm, metrics in _SERVING.items():
        for metric, values in metrics.items():
            unit, decimals = SERVING_METRICS[metric]
            for concurrency, value in zip(_CONCURRENCIES, values):
                rows.append({"figure": serving_figure_name(arm, concurrency, metric),
                             "value": float(value), "unit": unit, "decimals": decimals,
                             "hardware": HARDWARE, "date": "2026-07-07", "source": SOURCE})
    return pd.DataFrame(rows, columns=list(REFERENCE_COLUMNS))


def cross_engine_figures() -> pd.DataFrame:
    """The public reproduction's serving figures per engine, one row per arm: engine (a name of
    lib.engines.catalog), stack, output tok/s at each concurrency (columns c4, c8, c32),
    hardware, date, source."""
    rows = [{"engine": engine, "stack": stack,
             **{f"c{c}": float(v) for c, v in zip(_CONCURRENCIES, values)},
             "hardware": HARDWARE, "date": CROSS_ENGINE_DATE, "source": SOURCE}
            for engine, stack, values in _CROSS_ENGINE]
    return pd.DataFrame(rows)


def figures_from_summary(summary: pd.DataFrame, engine: str = "vllm") -> dict[str, float]:
    """Run figures named like the reference table, from a ``lib.measure.aiperf.read_exports`` table.

    Repeats of one cell are reduced to their median.
    """
    missing = [c for c in ("arm", "concurrency") if c not in summary]
    if missing:
        raise ValueError(f"figures_from_summary needs a read_exports table; missing {missing}")
    figures: dict[str, float] = {}
    for (arm, concurrency), cell in summary.groupby(["arm", "concurrency"]):
        for metric in SERVING_METRICS:
            values = pd.to_numeric(cell.get(metric), errors="coerce").dropna()
            if len(values):
                name = serving_figure_name(arm, concurrency, metric).replace("vllm", engine, 1)
                figures[name] = float(values.median())
    return figures


def figures_from_microbench(phases_us: Mapping[str, Any], dc_p50_us: float | None) -> dict:
    """Run figures from a test_ep result in the published shape (``lib.testep``)."""
    figures = {f"test_ep {phase} p50": float(stats["p50"]) for phase, stats in phases_us.items()
               if phase in ("dispatch", "combine")}
    if dc_p50_us is not None:
        figures["test_ep D+C p50"] = float(dc_p50_us)
    return figures


def figures_from_test_ep_gates(gates: list[Mapping[str, Any]],
                               tokens: int = MICROBENCH_TOKENS) -> dict[str, float]:
    """DeepEP's own test_ep figures at the published token count, from 03's gates (their
    observed dispatch, combine and D+C p50 of the first case); {} when that gate did not PASS
    or is absent (a run without DeepEP)."""
    name = _TEST_EP_DC_GATE.format(tokens=tokens)
    for g in gates:
        observed = g.get("observed") or {}
        if g.get("gate") == name and g.get("status") == "PASS" \
                and observed.get("num_tokens") == tokens:
            return {"test_ep dispatch p50": float(observed["dispatch_p50_us"]),
                    "test_ep combine p50": float(observed["combine_p50_us"]),
                    "test_ep D+C p50": float(observed["dc_p50_us"])}
    return {}


def _as_mapping(run_figures: pd.DataFrame | Mapping[str, float]) -> dict[str, float]:
    if isinstance(run_figures, pd.DataFrame):
        if not {"figure", "value"} <= set(run_figures.columns):
            raise ValueError("run_figures DataFrame needs columns 'figure' and 'value' "
                             f"(has {list(run_figures.columns)})")
        return dict(zip(run_figures["figure"], run_figures["value"]))
    return dict(run_figures)


def _measured(value: Any) -> bool:
    return value is not None and value is not pd.NA and not (
        isinstance(value, float) and math.isnan(value))


def compare(run_figures: pd.DataFrame | Mapping[str, float],
            reference: pd.DataFrame | None = None, tolerance: float = TOLERANCE) -> pd.DataFrame:
    """Each reference figure beside the run's value: ratio = run / reference and a flag.

    flag is 'within ±10%' (per ``tolerance``), 'outside ±10%', or 'not measured' when the run
    lacks the figure; ``outside_tolerance`` is the same as a nullable boolean (NA when not
    measured). Run figures that the reference does not have are left out.
    """
    reference = reference_figures() if reference is None else reference
    measured = _as_mapping(run_figures)
    band = f"±{tolerance * 100:g}%"
    rows = []
    for ref in reference.itertuples(index=False):
        value = measured.get(ref.figure)
        row = {"figure": ref.figure, "reference": ref.value, "unit": ref.unit,
               "run": float(value) if _measured(value) else math.nan}
        if not _measured(value):
            row.update(ratio=math.nan, outside_tolerance=pd.NA, flag="not measured")
        else:
            ratio = float(value) / ref.value
            outside = abs(ratio - 1) > tolerance
            row.update(ratio=ratio, outside_tolerance=outside,
                       flag=f"outside {band}" if outside else f"within {band}")
        row.update(hardware=ref.hardware, date=ref.date, source=ref.source)
        rows.append(row)
    table = pd.DataFrame(rows, columns=["figure", "reference", "unit", "run", "ratio",
                                        "outside_tolerance", "flag", "hardware", "date", "source"])
    table["outside_tolerance"] = table["outside_tolerance"].astype("boolean")
    return table


# ---- DeepEP V2 over EFA, by transport: what a reader sets a GIN type against ---------------------
# The GIN types: 2 is NCCL's CPU proxy (what the EFA installer 1.50.0 leaves NCCL on by default),
# 5 the GPU-initiated path (NCCL_GIN_TYPE=5 with NCCL_SYM_GIN_KERNELS_ENABLE=0), 3 GDAKI as the AWS
# serving sample configures it (NCCL_GIN_TYPE=3, OFI_NCCL_GIN_GDAKI=1).
EFA_TRANSPORT_COLUMNS = ("group", "figure", "gin_type", "nodes", "tokens", "phase", "concurrency",
                         "value", "unit", "decimals", "hardware", "setup", "date", "source_id",
                         "level")
# Type 2 against type 5 on p5en: the rows of lib/measure/cited_figures.yaml whose source is this
# campaign (one place for those numbers: the bounds page checks them against the transfer bound).
P5EN_GIN_SOURCE_ID = "whn09-official"
P5EN_GIN_GROUP = "GIN type 2 against type 5, 2 and 4 p5en nodes"
# amazon-contributing/DeepEP main at b90a617 on 2x p6-b300, 12 SMs, GIN type 5, 3 reps each
# (whn09/ep-benchmarks-efa results/b300_main_b90a617_20261008/tables.txt, "main b90a617 (new)",
# the mean of its reps): (tokens, phase, us).
P6_B300 = {
    "group": "DeepEP V2 on 2x p6-b300, GIN type 5",
    "hardware": "2x p6-b300.48xlarge (16x B300), 16 ranks over EFA",
    "setup": "amazon-contributing/DeepEP b90a617, test_ep, 12 SMs, mean of 3 reps; the shape is "
             "the kit's launcher's (hidden 7168, top-8 of 256 experts, FP8 dispatch), not "
             "restated in these tables",
    "date": "2026-10-08", "source_id": "whn09-b300-b90a617", "gin_type": 5, "nodes": 2,
    "figures": ((8192, "dispatch", 1050.5), (8192, "combine", 2868.9),
                (128, "dispatch", 129.5), (128, "combine", 163.4)),
}
# vLLM serving over GDAKI against the CPU proxy, the same nodes, image and day, the transport the
# only change (awslabs/awsome-distributed-ai PR #1231, examples/inference/vllm/deepep-v2-gdaki-efa/
# benchmarks/README.md, "Transport A/B", DP16/EP16, eager): output tok/s per concurrency, GDAKI
# (type 3) and proxy (type 2); and its CUDA-graph (non-eager) sweep's concurrency 64 on GDAKI.
GDAKI_SERVING = {
    "group": "vLLM deepep_v2 serving over GDAKI against the CPU proxy",
    "hardware": "2x p5en.48xlarge (16x H200), DP16/EP16 over EFA",
    "setup": "Qwen/Qwen3-30B-A3B-FP8, vLLM 0.22.1rc1.dev283 (e2f993dc4), --enforce-eager, 128 "
             "greedy output tokens, one sweep per arm",
    "date": "2026-08-14", "source_id": "aws-gdaki-benchmarks", "nodes": 2,
    "eager": {1: (5.5, 5.4), 8: (43.2, 42.5), 16: (87.2, 84.8), 32: (174.9, 172.4),
              64: (351.1, 341.9)},
    "graphs_c64_gdaki": 260.5,
}
