"""What public sources claim for the engines and lanes this guide does not run: the coverage
page's table of claims (the reproduction's serving figures per engine are data of their own,
lib.measure.published.cross_engine_figures). Each claim names its source as the book links it
(a name lib/publish/sources.yaml knows: a file at its commit, or a project's thread, which
lib.publish.sources.link_references turns into a link when the book is built) and the date the
source gives, or the date it was found when the source gives none ("as found"). REPRO is the
public 2x p5en reproduction's RESULTS.md; figures are theirs, not ours."""
from __future__ import annotations

from lib.measure.published import SOURCE as REPRO  # the public 2x p5en reproduction

CLAIMS = (
    {"engine": "vLLM", "claim": "deepep_v2 backend first released in 0.24.0 (vLLM #41183); "
     "needs NCCL >= 2.30.4", "source": "vLLM #41183", "date": "2026-04-29"},
    {"engine": "vLLM", "claim": "DeepEP V2 test_ep EP16 on 2x p5en over EFA: D+C p50 443.6 us, "
     "16 of 16 ranks exit 0", "source": REPRO, "date": "2026-07-06"},
    {"engine": "vLLM", "claim": "0.24.0 deepep_v2 serving on 2x p5en: EP_NUM_COMMS 8 over 1 "
     "is 2.02 / 1.97 / 1.89x output tok/s at c4 / 8 / 32, one run per arm",
     "source": REPRO, "date": "2026-07-07"},
    {"engine": "vLLM", "claim": "deepep_v2 without --enforce-eager: fixes merged after 0.24.0 "
     "(#46408, #47785, #52632); crash in cudagraph mode still reported (issue #52894, open PRs "
     "#51166, #55319)", "source": "vLLM issue #52894 and PRs #46408, #47785, #52632, #51166, "
     "#55319", "date": "as found 2026-12-01"},
    {"engine": "vLLM", "claim": "AWS sample, Qwen3-30B-A3B-FP8 DP16/EP16 on 2x p5en: eager "
     "4.8 to 301.8 tok/s (c1 to c64), CUDA graphs 5.0 to 239.7; not merged",
     "source": "awsome-distributed-ai PR #1230, its "
     "examples/inference/vllm/deepep-v2-efa/benchmarks/README.md",
     "date": "2026-08-14; the PR marked BLOCKED 2026-09-22"},
    {"engine": "SGLang", "claim": "a deepep_v2 backend merged upstream (#29525, relanded #35634)",
     "source": "SGLang #29525 and #35634", "date": "2026-08"},
    {"engine": "TensorRT-LLM", "claim": "NCCL EP backend only in 1.3.0rc24; illegal memory "
     "access at first dispatch on EFA reported (#17714, #17715)",
     "source": "TensorRT-LLM issues #17714 and #17715", "date": "as found 2026-12-01"},
    {"engine": "Megatron-LM", "claim": "2x8 H100 training steps with loss falling and EFA "
     "traffic recorded; nothing said of its all-to-all backend", "source": REPRO,
     "date": "2026-05-05"},
    {"engine": "NeMo-RL", "claim": "world 16 H100: a rollout passes; nothing said of its "
     "all-to-all backend", "source": REPRO, "date": "2026-04-29"},
    {"engine": "llm-d", "claim": "routing answered HTTP 200; defaults to LeaderWorkerSet, and "
     "v0.9.0 ships an EFA image with vLLM 0.26.0",
     "source": REPRO + "; the llm-d repository",
     "date": "2026-04-29; as found 2026-12-01"},
)
