"""Do two serves of one model answer alike? The check beside an A/B's throughput ratio.

A ratio of tokens per second says nothing about whether the faster arm computes the same model:
a serve whose MoE writes garbage rows (what vLLM 0.24.0's deepep_v2 no-expand layout does with
expert id -1, results/diagnostics/deepep_v2-expert-ids-20261201/) still streams tokens. So each
arm, once up and before its cells, is asked the same few prompts (``ask``: greedy, a few tokens,
the top logprobs of each), and each compared arm is held against the baseline arm (``compare``).

Per prompt, position by position while both chose the same token: the tokens both top lists
hold must be at least MIN_SHARED_TOP, and their logprobs within TOLERANCE_NATS. Where the chosen
tokens differ, the comparison of that prompt ends: a near tie (the baseline's top two within
TOLERANCE_NATS) is noise, anything else a different answer.

The numbers come from a measurement, not a guess: two correct serves of the guide's seeded model
on one H200 (vLLM 0.24.0, eager against CUDA graphs, results/diagnostics/vllm-answers-1xh200-
20261201/) chose the same token at 32 of 32 positions, shared 16 or more of their top 20 and
differed by at most 0.47 nats (bf16 logits: steps of 1/16). TOLERANCE_NATS is about twice that.
"""
from __future__ import annotations

from typing import Any

from lib.core.evidence import Gate, gate, skip

# Repeated words of growing length: the prompts the tolerance was measured on (record.py there)
PROMPTS = tuple(" ".join(["word"] * n) + f" {i}"
                for i, n in enumerate((3, 9, 17, 40, 77, 130, 260, 500)))
REQUEST = {"max_tokens": 4, "temperature": 0, "logprobs": 20}
TOLERANCE_NATS = 1.0
MIN_SHARED_TOP = 10  # of REQUEST["logprobs"]; correct serves shared 16 or more
ASK_TIMEOUT_S = 120.0
ANSWERS_FILE = "answers-{slug}.json"  # per arm (per start of an exclusive arm: its first)


def ask(stage, server, prompts: tuple[str, ...] = PROMPTS) -> list[dict[str, Any]]:
    """Each prompt alone, through the door: vLLM's answer as it came, or {"error": ...}."""
    answers = []
    for prompt in prompts:
        result = server.request(stage.door, "POST", "/v1/completions", timeout=ASK_TIMEOUT_S,
                                json_body={"model": server.model_dir, "prompt": prompt,
                                           **REQUEST})
        if result.status != 200:
            answers.append({"error": f"HTTP {result.status}: {result.error or result.body[:200]}"})
            continue
        try:
            answers.append(result.json())
        except ValueError:
            answers.append({"error": f"not JSON: {result.body[:200]}"})
    return answers


def _positions(answer: dict) -> list[tuple[str, dict[str, float]]] | None:
    """(chosen token, {token: logprob} of the top list) per generated position, or None."""
    try:
        logprobs = answer["choices"][0]["logprobs"]
        return list(zip(logprobs["tokens"], logprobs["top_logprobs"]))
    except (KeyError, IndexError, TypeError):
        return None


def compare_one(reference: dict, candidate: dict,
                tolerance: float = TOLERANCE_NATS) -> dict[str, Any]:
    """One prompt: {"agree": bool, "compared": positions, "max_diff": nats, "min_shared": n,
    "why": text}."""
    ref, cand = _positions(reference), _positions(candidate)
    if ref is None or cand is None:
        missing = "the baseline" if ref is None else "this arm"
        error = (reference if ref is None else candidate).get("error", "no logprobs")
        return {"agree": False, "compared": 0, "max_diff": None, "min_shared": None,
                "why": f"no answer with logprobs from {missing}: {error}"}
    worst, fewest, compared = 0.0, None, 0
    for position, ((ref_token, ref_top), (cand_token, cand_top)) in enumerate(zip(ref, cand)):
        shared = set(ref_top) & set(cand_top)
        fewest = len(shared) if fewest is None else min(fewest, len(shared))
        if len(shared) < MIN_SHARED_TOP:
            return {"agree": False, "compared": compared, "max_diff": round(worst, 4),
                    "min_shared": fewest, "why": f"position {position}: only {len(shared)} of "
                    f"the top tokens shared (at least {MIN_SHARED_TOP})"}
        diff = max(abs(ref_top[t] - cand_top[t]) for t in shared)
        worst = max(worst, diff)
        compared += 1
        if diff > tolerance:
            return {"agree": False, "compared": compared, "max_diff": round(worst, 4),
                    "min_shared": fewest, "why": f"position {position}: logprobs differ by "
                    f"{diff:.3f} nats (at most {tolerance})"}
        if ref_token != cand_token:
            top_two = sorted(ref_top.values(), reverse=True)[:2]
            gap = top_two[0] - top_two[1] if len(top_two) == 2 else float("inf")
            if gap <= tolerance:
                return {"agree": True, "compared": compared, "max_diff": round(worst, 4),
                        "min_shared": fewest, "why": f"position {position}: a near tie chosen "
                        f"the other way (top two {gap:.3f} nats apart); not compared further"}
            return {"agree": False, "compared": compared, "max_diff": round(worst, 4),
                    "min_shared": fewest, "why": f"position {position}: chose {cand_token!r}, "
                    f"the baseline {ref_token!r}, {gap:.3f} nats ahead"}
    return {"agree": True, "compared": compared, "max_diff": round(worst, 4),
            "min_shared": fewest, "why": "same tokens, logprobs within tolerance"}


def compare(reference: list[dict], candidate: list[dict],
            tolerance: float = TOLERANCE_NATS) -> list[dict[str, Any]]:
    """compare_one for each prompt, in order."""
    return [compare_one(r, c, tolerance) for r, c in zip(reference, candidate)]


def agreement_gate(b: str, a: str, reference: list[dict] | None, candidate: list[dict] | None,
                   evidence: list[str]) -> Gate:
    """`<b> answers as <a>`: PASS when every prompt agrees; SKIP when an arm was never asked."""
    name = f"{b} answers as {a}"
    if not reference or not candidate:
        never = a if not reference else b
        return skip(name, f"{never} was not asked (its server never served)", evidence)
    rows = compare(reference, candidate)
    bad = [f"prompt {i}: {r['why']}" for i, r in enumerate(rows) if not r["agree"]]
    if len(candidate) != len(reference):
        bad.append(f"{len(candidate)} answers to {len(reference)} prompts")
    worst = max((r["max_diff"] for r in rows if r["max_diff"] is not None), default=None)
    observed = {"prompts": len(rows), "agree": len(rows) - len(bad), "max_diff_nats": worst,
                "min_shared_top": min((r["min_shared"] for r in rows
                                       if r["min_shared"] is not None), default=None)}
    expected = (f"every prompt: the same greedy tokens (or a near tie), logprobs within "
                f"{TOLERANCE_NATS} nats, >= {MIN_SHARED_TOP} of the top {REQUEST['logprobs']} "
                "shared")
    reason = ("; ".join(bad) if bad else
              f"{b} computes what {a} computes, as far as {len(rows)} prompts show")
    return gate(name, not bad, observed, expected, reason, evidence)
