"""03's transport A/B on a cluster (`-p transport_ab true`): DeepEP's own test_ep at each token
count over both EFA contracts of lib.engines.transport, GIN type 2 (`efa`: the CPU proxy, the
published runs) and GIN type 5 (`gin_type5`: GPU-initiated, AWS's merged benchmark), on the same
nodes, the arms interleaved (A B, B A, ...) over `ab_repeats` so drift falls on both alike. Each
run is gated as 03 gates one (exit codes, correctness, the EFA provider on every rank, the
published p50 contract), and per token count the ratio type 5 / type 2 of the D+C p50 comes
with its paired bootstrap interval (lib.measure.stats), a gate that reports, never one that
judges: a reviewer reads the interval.

The public figures it stands beside (ANCHORS.md; cited, not measured here): the public
reproduction's type-5 campaign, dispatch 338.5 vs 391.6 us and combine 480.7 vs 543.4 us
against the CPU proxy (2026-07-14); whn09/ep-benchmarks-efa (2026-08), decode 2.2x slower at 2
nodes and 5.4x at 4 without NCCL_GIN_TYPE=5 and NCCL_SYM_GIN_KERNELS_ENABLE=0.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable

from lib.core.evidence import Gate, gate, skip
from lib.core.stage import Stage
from lib.measure import stats
from lib.places import Unsupported

TYPE2, TYPE5 = "efa", "gin_type5"
ARMS = (TYPE2, TYPE5)
LABELS = {TYPE2: "GIN type 2", TYPE5: "GIN type 5"}
RATIO = "type 5 / type 2"
COLUMNS = {TYPE2: "GIN type 2 D+C p50 (us)", TYPE5: "GIN type 5 D+C p50 (us)"}


def arm_order(repeats: int) -> list[tuple[int, str]]:
    """(repeat, transport): type 2 first on odd repeats, type 5 first on even ones."""
    return stats.interleaved(repeats, *ARMS)


def run_ab(stage: Stage, cfg: dict, tokens: int,
           run_one: Callable[..., tuple[dict | None, list[dict]]]) -> dict[str, Any] | None:
    """The A/B at `tokens`: `run_one(stage, cfg, tokens, transport=, tag=)` runs test_ep once
    (kernel.run_test_ep); its gates are added prefixed with the arm and repeat. Returns the
    runs (transport, repeat, D+C p50) and, where every run measured, the ratio; None for a
    plan (Unsupported: each arm's first run rendered, then one SKIP naming both)."""
    runs, planned = [], []
    for repeat, transport in arm_order(stage["ab_repeats"]):
        tag = f"{LABELS[transport]}, repeat {repeat}"
        try:
            case, gates = run_one(stage, cfg, tokens, transport=transport, tag=tag)
        except Unsupported as why:  # a plan: each arm's first run rendered and checked
            planned.append(f"{LABELS[transport]}: {why}")
            if len(planned) < len(ARMS):
                continue
            stage.add(skip(f"test_ep {tokens} tokens: transport A/B", "; ".join(planned)))
            return None
        stage.add(*[Gate(**{**g, "gate": f"test_ep {tokens} tokens, {tag}: {g['gate']}"})
                    for g in gates])
        value = (case or {}).get("dc_p50_us")
        print(f"test_ep {tokens} tokens, {tag}: D+C p50 "
              f"{'not measured' if value is None else f'{value:.1f} us'}", flush=True)
        runs.append({"tokens": tokens, "transport": transport, "repeat": repeat,
                     "dc_p50_us": value,
                     "failed": any(g["status"] == "FAIL" for g in gates)})
    return {"tokens": tokens, "runs": runs, "ratio": ratio_gate(stage, tokens, runs)}


def ratio_gate(stage: Stage, tokens: int, runs: list[dict]) -> dict | None:
    """The paired ratio type 5 / type 2 with its interval, as a gate that reports; None (and
    a FAIL naming the runs) where a run failed or measured nothing."""
    bad = [f"{LABELS[r['transport']]} repeat {r['repeat']}" for r in runs
           if r["failed"] or r["dc_p50_us"] is None]
    name = f"test_ep {tokens} tokens: D+C p50 ratio {RATIO} with its interval"
    evidence = [f"{stage.name}/transport_ab.json"]
    if bad:
        stage.add(gate(name, False, f"{len(runs) - len(bad)} of {len(runs)} runs measured",
                       f"{len(runs)} of {len(runs)}", "no ratio: not every run passed and "
                       f"measured ({', '.join(bad)})", evidence))
        return None
    by_arm = {t: [r["dc_p50_us"] for r in sorted(runs, key=lambda r: r["repeat"])
                  if r["transport"] == t] for t in ARMS}
    ratio = stats.paired_ratio(by_arm[TYPE2], by_arm[TYPE5], seed=stage["seed"])
    stage.add(Gate(name, "PASS", observed=[round(ratio["ratio"], 3), round(ratio["low"], 3),
                                           round(ratio["high"], 3)],
                   expected="ratio, low, high from scipy.stats.bootstrap",
                   reason=stats.time_ratio_verdict(ratio, "type 2", "GIN type 5"),
                   evidence=evidence))
    return ratio


def arm_median(result: dict | None, transport: str) -> float | None:
    """The median D+C p50 of an arm's runs that measured (None: none did, or a plan)."""
    values = [r["dc_p50_us"] for r in (result or {}).get("runs", [])
              if r["transport"] == transport and r["dc_p50_us"] is not None]
    return statistics.median(values) if values else None


def table_rows(results: list[dict]) -> list[dict]:
    """One row per token count: each arm's median D+C p50 and the ratio with its interval."""
    rows = []
    for result in results:
        row: dict[str, Any] = {"tokens": result["tokens"]}
        for transport in ARMS:
            row[COLUMNS[transport]] = arm_median(result, transport)
        ratio = result.get("ratio") or {}
        row[RATIO] = ratio.get("ratio")
        row["interval"] = (f"[{ratio['low']:.3f}, {ratio['high']:.3f}]" if ratio else
                           "not measured")
        rows.append(row)
    return rows
