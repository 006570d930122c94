"""03 with DeepEP: test_ep through lib.deepep's contract beside the torch benchmark, per token
count. DeepEP cannot run here (no GPU), so `deepep_dir` is a checkout whose
tests/elastic/test_ep.py is a double printing the REAL output recorded on two H200s
(../shared/fixtures/deepep-test_ep-2xh200/) for the --num-tokens it is given; the torch benchmark
beside it runs for real (gloo, 2 ranks)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lib.stages import registry as params
from lib.core.door import Door
from lib.core.errors import ParameterError
from lib.core.stage import Stage
from lib.stages import kernel
from tests.test_serve_vllm import nccl_site

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / \
    "deepep-test_ep-2xh200"
pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"{FIXTURES} absent")

TEST_EP = r'''import os, sys
import deep_ep  # as DeepEP's own test does: from the in-place build, through PYTHONPATH
args = sys.argv[1:]
tokens = args[args.index("--num-tokens") + 1]
assert "--skip-check" not in args
with open(os.environ["RECORD"], "a") as fh:
    fh.write(" ".join(args) + " | " + os.environ.get("EP_DISABLE_GIN", "") + " | "
             + os.environ.get("LD_PRELOAD", "") + " | " + deep_ep.__file__ + " | "
             + os.environ.get("PYTHONPATH", "") + "\n")
path = os.path.join({fixtures!r}, f"test_ep_{{tokens}}tok_h7168_top8_e256.log")
if not os.path.exists(path):
    print("RuntimeError: CUDA error: an illegal memory access", file=sys.stderr)
    sys.exit(1)
sys.stdout.write(open(path).read())
'''


def fake_deepep(tmp_path: Path) -> Path:
    root = tmp_path / "DeepEP"
    (root / "tests" / "elastic").mkdir(parents=True)
    (root / "tests" / "elastic" / "test_ep.py").write_text(TEST_EP.format(fixtures=str(FIXTURES)))
    # deep_ep is not installed anywhere: only the stage's PYTHONPATH can make it importable
    (root / "deep_ep").mkdir()
    (root / "deep_ep" / "__init__.py").write_text("")
    return root


def make_stage(tmp_path: Path, **given) -> Stage:
    run_dir = tmp_path / "run"
    return Stage("03_kernel_test", params.resolve("03_kernel_test", given), run_dir,
                 Door(run_dir, "03_kernel_test"), None)


def test_test_ep_per_token_count_beside_the_torch_benchmark(tmp_path, monkeypatch):
    record = tmp_path / "test_ep_calls.txt"
    monkeypatch.setenv("RECORD", str(record))
    site = nccl_site(tmp_path)
    stage = make_stage(tmp_path, deepep_dir=str(fake_deepep(tmp_path)), nccl_site=str(site),
                       test_ep_tokens="128,512,4096", iters=3, warmup=1)
    cfg = {**kernel.bench_config(stage, 0), "nproc": 2}  # gloo: the CPU's benchmark
    result, gates = kernel.run_bench(stage, cfg, "result.json")
    rows = kernel.run_test_ep_beside_bench(stage, cfg, result)
    by_name = {g.gate: g for g in stage.gates}
    for tokens in (128, 512, 4096):
        for name in ("test_ep exit code 0", "test_ep lines from every rank",
                     "dispatch+combine p50 recorded"):
            assert by_name[f"test_ep {tokens} tokens: {name}"].status == "PASS"
        assert by_name[f"test_ep {tokens} tokens: EFA provider selected on every rank"].status \
            == "SKIP"  # NVLink: no EFA
    for tokens in (512, 4096):  # the 128-token benchmark is the stage's own, reused
        assert by_name[f"torch benchmark {tokens} tokens: correctness"].status == "PASS"
    assert [r["tokens"] for r in rows] == [128, 512, 4096]
    # test_ep's D+C p50 at 128 tokens from the recorded output: dispatch + combine p50
    assert rows[0]["test_ep D+C p50 (us)"] == pytest.approx(29.2, abs=0.5)
    assert all(r["torch D+C p50 (us)"] and r["NCCL floor p50 (us)"] for r in rows)
    saved = json.loads((tmp_path / "run" / "03_kernel_test" / "test_ep.json").read_text())
    assert saved == json.loads(json.dumps(rows))
    calls = record.read_text().splitlines()
    assert len(calls) == 3
    assert all("--test-first-only" in c and "--num-processes 2" in c for c in calls)
    assert all(c.split(" | ")[1] == "1" for c in calls)  # EP_DISABLE_GIN=1
    assert all(c.split(" | ")[2] == str(site / "nvidia/nccl/lib/libnccl.so.2") for c in calls)
    # deep_ep imported from the checkout, the NCCL/NVSHMEM site first on the path (the order
    # that loads the pinned NVSHMEM: results/gpu-2xh200-deepep-20261130b.notes.md)
    deepep_dir = tmp_path / "DeepEP"
    assert all(c.split(" | ")[3] == str(deepep_dir / "deep_ep" / "__init__.py") for c in calls)
    assert all(c.split(" | ")[4].split(":")[:2] == [str(site), str(deepep_dir)] for c in calls)


def test_a_crashing_test_ep_fails_its_gates(tmp_path, monkeypatch):
    monkeypatch.setenv("RECORD", str(tmp_path / "calls.txt"))
    stage = make_stage(tmp_path, deepep_dir=str(fake_deepep(tmp_path)),
                       nccl_site=str(nccl_site(tmp_path)), test_ep_tokens="128,1024")
    cfg = {**kernel.bench_config(stage, 0), "nproc": 2}
    case, gates = kernel.run_test_ep(stage, cfg, 1024)  # no recorded output: the double crashes
    by_name = {g["gate"]: g for g in gates}
    assert case is None
    assert by_name["test_ep exit code 0"]["status"] == "FAIL"
    assert by_name["dispatch+combine p50 recorded"]["status"] == "FAIL"


def test_deepep_needs_its_nccl_site_before_anything_runs():
    with pytest.raises(ParameterError, match="'nccl_site'.*deepep_dir"):
        params.resolve("03_kernel_test", {"deepep_dir": "/opt/DeepEP"})


@pytest.mark.parametrize("stage, given", [
    ("04_serve", {"all2all_backend": "deepep_v2"}),
    ("05_sweep", {"ab_backends": "allgather_reducescatter,deepep_v2"}),
    ("06_multicomm", {"all2all_backend": "deepep_v2"}),
])
def test_vllm_deepep_backends_need_the_deepep_build_before_anything_runs(stage, given):
    """vLLM's deepep_* backends import deep_ep: on the local context that is DeepEP built in
    place here, so deepep_dir is required up front (not a worker's ImportError after minutes)."""
    given = {**given, "engine": "vllm", "nccl_site": "/w/site"}
    with pytest.raises(ParameterError, match="'deepep_dir'.*vLLM imports deep_ep"):
        params.resolve(stage, given)
    # engine '' becomes vLLM on a GPU machine only at run time: refused up front as well
    with pytest.raises(ParameterError, match="'deepep_dir'"):
        params.resolve(stage, {**given, "engine": ""})
    resolved = params.resolve(stage, {**given, "deepep_dir": "/w/DeepEP"})
    assert resolved["deepep_dir"] == "/w/DeepEP"
