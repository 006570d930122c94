"""03's transport A/B (lib.stages.transport_ab): its parameter refused where it cannot run, the
arms' order, the ratio and its verdict from each arm's D+C p50, a FAIL naming the run that did
not measure, and a plan rendering each arm's test_ep over its own contract. The control-plane
run of it: tests/test_kube_transport_ab.py."""
from __future__ import annotations

import json

import pytest

from lib.core.door import Door
from lib.core.errors import ParameterError
from lib.core.evidence import gate
from lib.core.stage import Stage
from lib.stages import kernel, registry, transport_ab
from tests.test_transport_levers import env_of

ABOVE_FLOOR = "newest-2026-12"  # the one pin set whose NCCL and EFA installer reach type 5


@pytest.mark.parametrize("given, words", [
    ({"context": "local", "transport_ab": "true"}, "false on the local context"),
    ({"context": "plan", "transport_ab": "true", "pin_set": "seed-2026-07"},
     f"allowed: false, or a pin_set whose NCCL is >= 2.31 and EFA installer >= 1.50 (-p "
     f"pin_set {ABOVE_FLOOR}): the A/B's GIN type 5 arm needs what pin set 'seed-2026-07' "
     "lacks: nccl 2.30.4 < 2.31"),
    ({"context": "kube", "transport_ab": "true", "pin_set": "current"}, "pin set 'current'"),
    ({"context": "plan", "transport_ab": "maybe"}, "true or false"),
])
def test_the_ab_is_refused_off_a_cluster_and_below_type_5s_floor_naming_the_parameter(given,
                                                                                        words):
    with pytest.raises(ParameterError) as refused:
        registry.resolve("03_kernel_test", given)
    assert refused.value.name == "transport_ab", refused.value
    assert words in str(refused.value), str(refused.value)


def test_the_ab_is_taken_on_a_cluster_above_the_floor_with_either_contract_asked():
    for asked in ("efa", "gin_type5"):
        p = registry.resolve("03_kernel_test", {"context": "plan", "transport_ab": "true",
                                                "pin_set": ABOVE_FLOOR, "transport": asked})
        assert p["transport_ab"] is True and p["ab_repeats"] == 5
    assert registry.resolve("03_kernel_test", {"context": "plan"})["transport_ab"] is False


def test_the_arms_alternate_which_goes_first():
    assert transport_ab.arm_order(3) == [(1, "efa"), (1, "gin_type5"), (2, "gin_type5"),
                                         (2, "efa"), (3, "efa"), (3, "gin_type5")]


def ab_stage(run_dir, **given) -> Stage:
    resolved = registry.resolve("03_kernel_test", {
        "context": "plan", "transport_ab": "true", "pin_set": ABOVE_FLOOR,
        "ab_repeats": "3", **given})
    return Stage("03_kernel_test", resolved, run_dir, Door(run_dir, "03_kernel_test", plan=True),
                 None)


def runs_of(values: dict[tuple[int, str], float | None]):
    """What kernel.run_test_ep returns for each (repeat, transport): test_ep's first case (its
    D+C p50) and its gates, a run without a value FAILing its exit gate."""
    seen = []

    def run_one(stage, cfg, tokens, *, transport, tag):
        repeat = int(tag.rsplit(" ", 1)[1])
        seen.append((repeat, transport))
        value = values[(repeat, transport)]
        return ({"dc_p50_us": value} if value is not None else None,
                [gate("test_ep exit 0 on every node", value is not None,
                      0 if value is not None else 1, 0, "recorded", []).as_dict()])
    return run_one, seen


def test_the_ratio_is_type_5_over_type_2_with_its_interval_and_verdict(tmp_path):
    stage = ab_stage(tmp_path)
    type2, type5 = [391.6, 402.0, 388.1], [338.5, 345.2, 341.0]
    run_one, seen = runs_of({**{(r + 1, "efa"): v for r, v in enumerate(type2)},
                             **{(r + 1, "gin_type5"): v for r, v in enumerate(type5)}})
    result = transport_ab.run_ab(stage, {}, 128, run_one)
    assert seen == transport_ab.arm_order(3)
    ratio = result["ratio"]
    assert ratio["ratio"] == pytest.approx(341.0 / 391.6)  # medians, b over a
    assert ratio["paired"] and ratio["high"] < 1
    (row,) = [g for g in stage.gates if "ratio" in g.gate]
    assert row.gate == "test_ep 128 tokens: D+C p50 ratio type 5 / type 2 with its interval"
    assert row.status == "PASS" and row.reason.startswith("GIN type 5 is faster than type 2")
    assert "test_ep 128 tokens, GIN type 5, repeat 2: test_ep exit 0 on every node" in [
        g.gate for g in stage.gates]
    (table,) = transport_ab.table_rows([result])
    assert table["GIN type 2 D+C p50 (us)"] == 391.6 and table["GIN type 5 D+C p50 (us)"] == 341.0


def test_a_run_that_did_not_measure_fails_the_ratio_naming_it(tmp_path):
    stage = ab_stage(tmp_path, ab_repeats="2")
    values = {(1, "efa"): 390.0, (1, "gin_type5"): 340.0, (2, "gin_type5"): None,
              (2, "efa"): 392.0}
    result = transport_ab.run_ab(stage, {}, 512, runs_of(values)[0])
    assert result["ratio"] is None
    (row,) = [g for g in stage.gates if "ratio" in g.gate]
    assert row.status == "FAIL" and row.observed == "3 of 4 runs measured"
    assert "(GIN type 5 repeat 2)" in row.reason
    assert transport_ab.table_rows([result])[0]["interval"] == "not measured"


def test_a_plan_renders_each_arm_over_its_own_contract_and_skips_the_ab(tmp_path):
    """`-p context plan -p transport_ab true -p pin_set newest-2026-12`: test_ep's rank job of
    each arm rendered (type 2's env, type 5's env), checked, and one SKIP of the A/B per token
    count naming both; no FAIL, nothing measured."""
    stage = ab_stage(tmp_path, test_ep_tokens="128")
    kernel.run(stage)
    manifests = sorted((tmp_path / "03_kernel_test" / "manifests").glob("test-ep-*.yaml"))
    contracts = sorted(env_of(p.read_text())["NCCL_GIN_TYPE"] for p in manifests)
    assert contracts == ["2", "5"], [p.name for p in manifests]
    assert not [g for g in stage.gates if g.status == "FAIL"], \
        [(g.gate, g.reason) for g in stage.gates if g.status == "FAIL"]
    (skipped,) = [g for g in stage.gates if g.gate == "test_ep 128 tokens: transport A/B"]
    assert skipped.status == "SKIP"
    assert "GIN type 2: " in skipped.reason and "; GIN type 5: " in skipped.reason
    assert json.loads((tmp_path / "03_kernel_test" / "transport_ab.json").read_text()) == []
