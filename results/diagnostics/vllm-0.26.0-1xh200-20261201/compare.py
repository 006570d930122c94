"""Compare this folder's answers (vLLM 0.26.0) with the earlier diagnostic's (vLLM 0.24.0): same
seeded model (config hash checked), same 8 prompts, same request. Runs anywhere (no GPU):
    python3 results/diagnostics/vllm-0.26.0-1xh200-20261201/compare.py > compare.json

Per pair of answer lists, over the 8 prompts x 4 generated positions:
- tokens_same: positions where both chose the same token (position by position);
- max_diff_nats: the largest |logprob difference| over the tokens both top-20 lists hold, at
  positions whose context is the same (every earlier generated token the same; after a token
  differs the two continue from different texts and are not compared);
- min_shared_top: the fewest tokens the two top-20 lists shared at such a position;
- agreement: lib.measure.agreement.compare's verdict (the guide's check: 1.0 nats, >= 10 shared).
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, REPO)
from lib.measure.agreement import compare  # noqa: E402

EARLIER = os.path.join(REPO, "results", "diagnostics", "vllm-answers-1xh200-20261201",
                       "answers.json")


def positions(answer):
    lp = answer["choices"][0]["logprobs"]
    return list(zip(lp["tokens"], lp["top_logprobs"]))


def pair(a, b):
    same = total = 0
    worst, worst_at, fewest = 0.0, None, None
    for i, (x, y) in enumerate(zip(a, b)):
        px, py = positions(x), positions(y)
        context_same = True
        for j, ((tx, topx), (ty, topy)) in enumerate(zip(px, py)):
            total += 1
            same += tx == ty
            if context_same:
                shared = set(topx) & set(topy)
                fewest = len(shared) if fewest is None else min(fewest, len(shared))
                d = max(abs(topx[t] - topy[t]) for t in shared)
                if d > worst:
                    worst, worst_at = d, {"prompt": i, "position": j}
            context_same = context_same and tx == ty
    verdict = compare(a, b)
    return {"tokens_same": same, "positions": total, "max_diff_nats": round(worst, 4),
            "max_diff_at": worst_at, "min_shared_top": fewest,
            "agreement": {"prompts_agree": sum(r["agree"] for r in verdict),
                          "prompts": len(verdict),
                          "max_diff_nats": max(r["max_diff"] for r in verdict)}}


def main():
    new = json.load(open(os.path.join(HERE, "answers.json")))
    old = json.load(open(EARLIER))
    assert new["model"]["config_hash"] == old["model"]["config_hash"], "different models"
    assert new["prompts"] == old["prompts"] and new["request"] == old["request"]
    n, o = new["arms"], old["arms"]
    prompt_tokens = {f"{v}:{arm}": [a["usage"]["prompt_tokens"] for a in arms[arm]["alone"]]
                     for v, arms in (("0.24.0", o), ("0.26.0", n)) for arm in arms}
    out = {
        "model": new["model"]["config_hash"],
        "prompt_tokens": prompt_tokens,
        "0.26.0 against 0.24.0": {
            f"{arm} {mode}": pair(o[arm][mode], n[arm][mode])
            for arm in ("eager", "graphs") for mode in ("alone", "batched")},
        "0.26.0 graphs against 0.24.0 eager, alone": pair(o["eager"]["alone"],
                                                          n["graphs"]["alone"]),
        "within 0.26.0": {
            "eager against graphs, alone": pair(n["eager"]["alone"], n["graphs"]["alone"]),
            "alone against batched, eager": pair(n["eager"]["alone"], n["eager"]["batched"]),
            "alone against batched, graphs": pair(n["graphs"]["alone"], n["graphs"]["batched"]),
        },
        "within 0.24.0 (the earlier diagnostic, recomputed)": {
            "eager against graphs, alone": pair(o["eager"]["alone"], o["graphs"]["alone"]),
            "alone against batched, eager": pair(o["eager"]["alone"], o["eager"]["batched"]),
            "alone against batched, graphs": pair(o["graphs"]["alone"], o["graphs"]["batched"]),
        },
        "identical answers (tokens and every top-20 logprob)": {
            f"{arm} {mode}": sum(positions(x) == positions(y)
                                 for x, y in zip(o[arm][mode], n[arm][mode]))
            for arm in ("eager", "graphs") for mode in ("alone", "batched")},
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
