"""lib.agreement on vLLM 0.24.0's real answers (eager and CUDA-graph serves of the seeded model on
1x H200, results/diagnostics/vllm-answers-1xh200-20261201/): correct serves agree, a serve that
answers another prompt does not, and each way a comparison can end says why."""
import copy
import json

import pytest

from lib.measure import agreement
from lib.core.door import REPO_ROOT

RECORDED = json.loads((REPO_ROOT / "results" / "diagnostics" / "vllm-answers-1xh200-20261201"
                       / "answers.json").read_text())
EAGER = RECORDED["arms"]["eager"]
GRAPHS = RECORDED["arms"]["graphs"]


def test_the_prompts_are_the_ones_the_tolerance_was_measured_on():
    assert list(agreement.PROMPTS) == RECORDED["prompts"]
    assert RECORDED["request"] == agreement.REQUEST


def test_two_correct_serves_agree_within_the_measured_noise():
    for reference, candidate in ((EAGER["alone"], GRAPHS["alone"]),
                                 (EAGER["alone"], EAGER["batched"]),
                                 (GRAPHS["alone"], GRAPHS["batched"])):
        rows = agreement.compare(reference, candidate)
        assert [r["agree"] for r in rows] == [True] * 8
        assert all(r["compared"] == 4 and r["min_shared"] >= 16 for r in rows)
    worst = max(r["max_diff"] for r in agreement.compare(EAGER["alone"], GRAPHS["alone"]))
    assert worst == pytest.approx(0.4708, abs=1e-4)  # the diagnostic's figure
    assert worst < agreement.TOLERANCE_NATS / 2


def test_answers_to_other_prompts_do_not_agree():
    rows = agreement.compare(EAGER["alone"][:-1], EAGER["alone"][1:])
    assert [r["agree"] for r in rows[:6]] == [False] * 6
    assert rows[0]["why"] == "position 0: only 0 of the top tokens shared (at least 10)"
    assert rows[2]["why"].startswith("position 0: logprobs differ by 5.19")


def shifted(answer: dict, position: int, delta: float) -> dict:
    """The answer with every logprob at `position` moved by delta, except the chosen token's."""
    out = copy.deepcopy(answer)
    lp = out["choices"][0]["logprobs"]
    chosen = lp["tokens"][position]
    lp["top_logprobs"][position] = {t: v + (0 if t == chosen else delta)
                                    for t, v in lp["top_logprobs"][position].items()}
    return out


def swapped(answer: dict, position: int) -> dict:
    """The answer choosing its second token at `position` (the top list unchanged)."""
    out = copy.deepcopy(answer)
    lp = out["choices"][0]["logprobs"]
    top = sorted(lp["top_logprobs"][position].items(), key=lambda kv: -kv[1])
    lp["tokens"][position] = top[1][0]
    return out


def test_each_way_a_comparison_ends():
    ref = EAGER["alone"][0]
    top = sorted(ref["choices"][0]["logprobs"]["top_logprobs"][1].values(), reverse=True)
    # position 1 of prompt 0: its top two are 0.375 nats apart (a near tie at tolerance 1.0)
    assert top[0] - top[1] == pytest.approx(0.375)
    tie = agreement.compare_one(ref, swapped(ref, 1))
    assert tie["agree"] and tie["compared"] == 2 and "near tie" in tie["why"]
    # position 0: 1.0 nat apart, so choosing the second is a different answer at 0.5 nats
    strict = agreement.compare_one(ref, swapped(ref, 0), tolerance=0.5)
    assert not strict["agree"] and strict["why"].startswith("position 0: chose ' never'")
    moved = agreement.compare_one(ref, shifted(ref, 3, 1.5))
    assert not moved["agree"] and moved["compared"] == 4
    assert moved["why"] == "position 3: logprobs differ by 1.500 nats (at most 1.0)"
    assert agreement.compare_one(ref, shifted(ref, 3, 0.9))["agree"]
    broken = agreement.compare_one(ref, {"error": "HTTP 500: boom"})
    assert not broken["agree"] and broken["why"] == \
        "no answer with logprobs from this arm: HTTP 500: boom"
    bare = copy.deepcopy(ref)
    bare["choices"][0]["logprobs"] = None
    assert "from the baseline: no logprobs" in agreement.compare_one(bare, ref)["why"]


def test_the_gate_passes_fails_and_skips_with_its_reason():
    ok = agreement.agreement_gate("graphs", "eager", EAGER["alone"], GRAPHS["alone"], ["f"])
    assert ok.status == "PASS" and ok.observed["agree"] == 8 and ok.evidence == ["f"]
    bad = agreement.agreement_gate("graphs", "eager", EAGER["alone"],
                                   GRAPHS["alone"][:7] + [{"error": "HTTP 500: x"}], [])
    assert bad.status == "FAIL" and bad.observed["agree"] == 7
    assert bad.reason == "prompt 7: no answer with logprobs from this arm: HTTP 500: x"
    short = agreement.agreement_gate("graphs", "eager", EAGER["alone"], GRAPHS["alone"][:5], [])
    assert short.status == "FAIL" and short.reason == "5 answers to 8 prompts"
    never = agreement.agreement_gate("graphs", "eager", EAGER["alone"], None, [])
    assert never.status == "SKIP" and never.reason.startswith("graphs was not asked")
