"""lib.measure.bounds: DeepEP V2's bytes per link against hand-computed cases and the bytes
test_ep itself printed on the guide's 2x H200, the bound against what was measured, the latency
fit (the guide's own runs only), the data files against their sources, and the CLI."""

import json
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import yaml

from lib.measure import bounds
from lib.measure.bounds import (checked_table, dispatch_tokens, guide_cases, latency_fit,
                                make_shape, measured_routing, phase_bytes, token_bytes,
                                uniform_routing)
from lib.measure.testep import first_case, parse_test_ep_log, read_published_microbench

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
FIXTURE_LOGS = SHARED / "fixtures" / "deepep-test_ep-2xh200"
PUBLISHED_T2 = (SHARED / "fixtures" / "public-repro" / "results" / "vllm-deepep-dropin-20260706"
                / "vllm" / "t2_ep16_2node_test_ep_microbench.json")
GUIDE_RUN = "results/gpu-2xh200-deepep-20261130b"
FIT_RUN = "results/gpu-2xh200-deepep-20261130c"


def shape(**overrides):
    base = dict(tokens=128, hidden=7168, topk=8, experts=256, ranks_per_node=8, nodes=2)
    return make_shape(**{**base, **overrides})


def miss(experts: int, topk: int, group: int) -> Fraction:
    """P(no top-k pick lands in a group), multiplied out pick by pick (not math.comb)."""
    p = Fraction(1)
    for i in range(topk):
        p *= Fraction(experts - group - i, experts - i)
    return p


# ---- bytes per token: test_ep's own count ----------------------------------------------------
def test_token_bytes_by_hand():
    # FP8: 7168 x 1 byte + 7168 / 128 fp32 scales + 8 x (int64 index + fp32 weight)
    assert token_bytes(shape(), "dispatch") == 7168 + 56 * 4 + 8 * 12 == 7488
    assert token_bytes(shape(dispatch_dtype="bf16"), "dispatch") == 14336 + 96
    # combine: BF16 x + fp32 top-k weights
    assert token_bytes(shape(), "combine") == 14336 + 32 == 14368


# ---- hand-computed cases ---------------------------------------------------------------------
def test_one_node_two_ranks():
    s = shape(ranks_per_node=2, nodes=1)
    p = 1 - miss(256, 8, 128)
    got = phase_bytes(s)["dispatch"]
    for rank in range(2):
        assert got["nvlink_send"][rank] == pytest.approx(float(128 * p * 7488))
        assert got["nvlink_recv"][rank] == pytest.approx(float(128 * p * 7488))
        assert got["local"][rank] == pytest.approx(float(128 * p * 7488))
        assert got["rdma_send"][rank] == got["rdma_recv"][rank] == 0


def test_two_nodes_hybrid_and_direct():
    # 2 nodes x 2 ranks, 8 experts (2 per rank, 4 per node), top-2, 6 tokens per rank
    p_rank = 1 - Fraction(15, 28)  # C(6,2) / C(8,2) misses a rank
    p_node = 1 - Fraction(6, 28)   # C(4,2) / C(8,2) misses a node
    assert 1 - miss(8, 2, 2) == p_rank and 1 - miss(8, 2, 4) == p_node
    hybrid = shape(tokens=6, hidden=128, topk=2, experts=8, ranks_per_node=2)
    t = dispatch_tokens(hybrid, uniform_routing(hybrid))
    # RDMA once per OTHER node; NVLink: own node's other rank + the forwarded other node's
    assert t["rdma_send"] == pytest.approx([float(6 * p_node)] * 4)
    assert t["rdma_recv"] == pytest.approx([float(6 * p_node)] * 4)
    assert t["nvlink_send"] == pytest.approx([float(2 * 6 * 1 * p_rank)] * 4)
    assert t["local"] == pytest.approx([float(6 * p_rank)] * 4)
    direct = shape(tokens=6, hidden=128, topk=2, experts=8, ranks_per_node=2, mode="direct")
    t = dispatch_tokens(direct, uniform_routing(direct))
    assert t["rdma_send"] == pytest.approx([float(6 * 2 * p_rank)] * 4)  # once per remote rank
    assert t["nvlink_send"] == pytest.approx([float(6 * 1 * p_rank)] * 4)


def test_top1():
    one_node = shape(topk=1, experts=16, ranks_per_node=8, nodes=1, tokens=64)
    t = dispatch_tokens(one_node, uniform_routing(one_node))
    assert t["nvlink_send"] == pytest.approx([64 * 7 / 8] * 8)  # 2 of 16 experts per rank
    two_nodes = shape(topk=1, experts=16, ranks_per_node=8, nodes=2, tokens=64)
    t = dispatch_tokens(two_nodes, uniform_routing(two_nodes))
    assert t["rdma_send"] == pytest.approx([64 / 2] * 16)  # half the experts are remote
    # a top-1 token never reaches two ranks: hybrid forwarding sends nothing twice
    assert t["nvlink_send"] == pytest.approx([2 * 64 * 7 / 16] * 16)
    # a top-1 token reaches exactly one rank: every source's counts add up to its tokens
    assert uniform_routing(two_nodes).rank_tokens.sum(1) == pytest.approx([64] * 16)


def test_every_token_to_one_rank():
    s = shape(tokens=10, hidden=128, topk=1, experts=4, ranks_per_node=2)
    ranks = np.zeros((4, 4))
    ranks[:, 0] = 10
    nodes = np.zeros((4, 2))
    nodes[:, 0] = 10
    t = dispatch_tokens(s, measured_routing(s, ranks, nodes))
    # rank 1 sends its own 10 over NVLink and forwards rank 3's 10 (RDMA'd to it) to rank 0;
    # rank 2's tokens land by RDMA on rank 0 itself, the same local index: no NVLink hop.
    assert t["local"].tolist() == [10, 0, 0, 0]
    assert t["nvlink_recv"].tolist() == [20, 0, 0, 0]
    assert t["nvlink_send"].tolist() == [0, 20, 0, 0]
    assert t["rdma_send"].tolist() == [0, 0, 10, 10]
    assert t["rdma_recv"].tolist() == [10, 10, 0, 0]
    direct = make_shape(tokens=10, hidden=128, topk=1, experts=4, ranks_per_node=2, nodes=2,
                        mode="direct")
    t = dispatch_tokens(direct, measured_routing(direct, ranks, nodes))
    assert t["rdma_recv"].tolist() == [20, 0, 0, 0] and t["nvlink_recv"].tolist() == [10, 0, 0, 0]
    # combine is the same tokens back: rank 0 is now the busiest sender
    combine = phase_bytes(s, measured_routing(s, ranks, nodes))["combine"]
    assert combine["nvlink_send"][0] == 20 * token_bytes(s, "combine")


def test_measured_routing_without_node_counts_takes_their_least():
    s = shape(tokens=10, hidden=128, topk=2, experts=4, ranks_per_node=2)
    ranks = np.array([[0, 0, 4, 3], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]], dtype=float)
    routing = measured_routing(s, ranks)
    assert routing.node_tokens[0].tolist() == [0, 4]  # max(4, 3): a token may hit both ranks
    assert "least" in routing.notes[0]
    # a recorded routing outside the model (data, not a parameter): ValueError naming it
    with pytest.raises(ValueError, match="node_tokens"):
        measured_routing(s, ranks, [[0, 8], [0, 0], [0, 0], [0, 0]])  # more than 4 + 3
    with pytest.raises(ValueError, match="rank_tokens.*4 x 4"):
        measured_routing(s, np.zeros((3, 3)))
    with pytest.raises(ValueError, match="rank_tokens"):
        measured_routing(s, -ranks)


@pytest.mark.parametrize("overrides, name", [
    (dict(tokens=0), "tokens"), (dict(experts=100), "experts"),
    (dict(topk=300, experts=256), "topk"), (dict(hidden=100), "hidden")])
def test_a_shape_outside_the_model_names_its_field(overrides, name):
    """A shape the model cannot take (03's, the book's, a cited figure's, a recorded run's):
    shape_problem names the field and what the model takes, make_shape raises it as a
    ValueError (the command line says it of its flag: test_cli_refuses_bad_flags). The dtypes
    and the mode are types (DispatchDtype, CombineDtype, Mode; the command line's choices)."""
    given = {**dict(tokens=128, hidden=7168, topk=8, experts=256, ranks_per_node=8, nodes=2),
             **overrides}
    problem = bounds.shape_problem(**given)
    assert problem is not None and problem[0] == name and problem[2]
    with pytest.raises(ValueError, match=f"^{name} = .* is outside the bound's model"):
        shape(**overrides)
    assert make_shape(tokens=1, hidden=100, topk=1, experts=2, ranks_per_node=2, nodes=1,
                      dispatch_dtype="bf16").hidden == 100  # BF16 needs no 128-channel blocks


# ---- against the bytes test_ep itself printed on 2x H200 ---------------------------------------
def _test_ep_logs():
    logs = [c["log"] for run in (GUIDE_RUN, FIT_RUN) for c in guide_cases(run)]
    assert FIXTURE_LOGS.is_dir(), f"fixtures missing: {FIXTURE_LOGS}"
    return logs + sorted(str(p) for p in FIXTURE_LOGS.glob("*.log"))


@pytest.mark.parametrize("log", _test_ep_logs())
def test_bytes_test_ep_printed(log):
    """test_ep prints, per rank, the bytes it received over scale-up (local traffic included)
    and GB/s = bytes / time; its bytes per token are ours exactly, its token count is one draw
    of the routing whose expectation the model gives."""
    case = first_case(parse_test_ep_log(log))
    s = bounds.shape_of_case(case)
    model = dispatch_tokens(s, uniform_routing(s))
    expected = float(model["local"][0] + model["nvlink_recv"][0])
    p = bounds.hit_probability(s.experts, s.topk, s.experts // s.ranks)
    sigma = (s.ranks * s.tokens * p * (1 - p)) ** 0.5
    for record in case["per_rank"]:
        phase = "combine" if "combine" in record["phase"] else "dispatch"
        tokens = record["bytes"] / token_bytes(s, phase)
        assert tokens == int(tokens), f"{record}: not a whole number of {phase} tokens"
        # test_ep gives rank r max(1, tokens - r) tokens: at most ranks - 1 fewer than the model
        assert abs(tokens - expected) <= 4 * sigma + s.ranks, (record, expected)
        assert record["su_gbps"] == pytest.approx(record["bytes"] / record["us"] / 1e3, abs=1)
        assert record["so_gbps"] == 0  # one node: nothing scales out


def test_published_cross_node_scaleout_rate_matches_the_rdma_bytes():
    """R's wrapper ran test_ep with ignore_local_traffic, so its SO bytes are the remote-node
    tokens: our RDMA bytes. It reports "scaleout ~5 GB/s per rank" at dispatch p50 185.4 us."""
    document = read_published_microbench(PUBLISHED_T2)
    s = shape()
    rdma = phase_bytes(s)["dispatch"]["rdma_send"][0]
    gbps = rdma / document["phases_us"]["dispatch"]["p50"] / 1e3
    assert re.search(r"scaleout ~5 GB/s per rank", document["efa_proof"])
    assert round(gbps) == 5


# ---- the fit: the guide's own runs only ------------------------------------------------------
def test_fit_is_on_the_guide_runs_named_and_shown():
    links = yaml.safe_load(bounds.LINKS_PATH.read_text())
    fit = latency_fit()
    assert fit["runs"] == links["nvlink"]["h200-nccl-2gpu"]["fit_runs"] == [FIT_RUN]
    assert {p["run"] for p in fit["points"]} == {FIT_RUN}
    assert {(p["tokens"], p["phase"]) for p in fit["points"]} == {
        (t, ph) for t in (128, 512, 4096) for ph in ("dispatch", "combine")}
    # lower envelope: the least residual, so no fitted point is below its bound
    assert fit["latency_us"] == min(p["residual_us"] for p in fit["points"]) > 0
    for p in fit["points"]:
        assert p["residual_us"] == pytest.approx(p["measured_us"] - p["transfer_us"])
        assert p["measured_us"] >= p["transfer_us"] + fit["latency_us"] - 1e-9
    assert fit["mean_residual_us"] > fit["latency_us"] and "lower envelope" in fit["method"]


def test_fit_follows_its_data(tmp_path):
    links = yaml.safe_load(bounds.LINKS_PATH.read_text())
    links["nvlink"]["h200-nccl-2gpu"]["fit_runs"] = [GUIDE_RUN]
    other = tmp_path / "links.yaml"
    other.write_text(yaml.safe_dump(links))
    refit = latency_fit(links_path=other)
    assert {p["run"] for p in refit["points"]} == {GUIDE_RUN}
    assert refit["latency_us"] != latency_fit()["latency_us"]
    links["nvlink"]["h200-nccl-2gpu"]["fit_runs"] = ["results/kube-ctlplane-20261207g"]
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(links))
    with pytest.raises((ValueError, FileNotFoundError), match="kube-ctlplane-20261207g"):
        latency_fit(links_path=broken)
    with pytest.raises(ValueError, match="h200-nccl-2gpu"):
        latency_fit("b200-deepep-readme")


# ---- checked against what was measured -------------------------------------------------------
def test_checked_table():
    table = checked_table()
    assert not table.fitted_on.any()  # no row is checked against its own fit
    guide = table[table.kind == "guide run"]
    dc = guide[guide.phase == "dc"].sort_values("tokens")
    # the guide's own D+C, read from the committed run through lib.measure.testep
    assert dc.tokens.tolist() == [128, 512, 4096]
    assert [round(v, 1) for v in dc.measured_us] == [29.9, 56.6, 299.0]
    assert (table.ratio == table.measured_us / table.bound_us).all()
    # a lower bound lies below every measurement, the guide's and the clusters'
    assert (table.ratio >= 1).all(), table[table.ratio < 1]
    # at 4096 tokens on NVLink DeepEP runs within a few percent of the wire ...
    assert dc.ratio.iloc[-1] < 1.1
    # ... across nodes over EFA at 128 tokens it does not: the CPU proxy's issue rate
    gate1 = table[(table.figure == "repro-gate1-proxy") & (table.phase == "dc")].iloc[0]
    assert gate1.measured_us == 443.6 and gate1.ratio > 5 and gate1.bottleneck == "rdma / rdma"
    assert table.source.str.len().gt(0).all() and table.date.str.len().gt(0).all()


def test_cited_figures_match_their_references():
    cited = {e["id"]: e for e in yaml.safe_load(bounds.CITED_PATH.read_text())["cited"]}
    document = read_published_microbench(PUBLISHED_T2)
    gate1 = cited["repro-gate1-proxy"]["phases"]
    assert gate1 == {"dispatch": document["phases_us"]["dispatch"]["p50"],
                     "combine": document["phases_us"]["combine"]["p50"],
                     "dc": document["dc_p50_us"]}
    assert cited["repro-gate1-proxy"]["tokens"] == document["config"]["num_tokens"]
    from lib.measure.published import reference_figures
    published = dict(zip(reference_figures().figure, reference_figures().value))
    assert published["test_ep D+C p50"] == gate1["dc"]
    anchors = (SHARED / "reference" / "ANCHORS.md").read_text()
    for figure in ("338.5", "480.7", "1665 us", "367 / combine 178 us", "385 us"):
        assert figure in anchors, figure
    assert cited["aws-b200-native-fp8"]["phases"]["dc"] == 384.994  # ANCHORS' "385 us"


def test_link_figures_match_their_sources():
    links = yaml.safe_load(bounds.LINKS_PATH.read_text())
    toolchain = (SHARED / "reference" / "TOOLCHAIN.md").read_text()
    curve = links["nvlink"]["h200-nccl-2gpu"]["curve_GBps_by_MiB_per_rank"]
    said = (" / ".join(map(str, curve.values())) + " GB/s bus bandwidth at "
            + " / ".join(map(str, curve)) + " MiB per rank")
    assert said in re.sub(r"\s+", " ", toolchain)
    assert bounds.efa_bandwidth(links["efa"]["p5en-efa"]) == 50.0  # ANCHORS: 50 GB/s per GPU
    assert bounds.efa_bandwidth(links["efa"]["p5-efa"]) == 50.0
    for table in ("nvlink", "efa"):
        for name, entry in links[table].items():
            assert entry.get("source") and entry.get("date"), name


# ---- the command line ------------------------------------------------------------------------
def cli(*args):
    return subprocess.run([sys.executable, "-m", "lib.measure.bounds", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_cli_prints_bytes_bounds_and_sources():
    done = cli("--ranks-per-node", "8", "--nodes", "2", "--tokens", "128", "--hidden", "7168",
               "--topk", "8", "--experts", "256")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    expected = bounds.bound(shape())
    rdma = expected["phases"]["dispatch"]["bytes_per_rank"]["rdma"]
    assert re.search(r"across nodes \(RDMA/EFA\)\s+%.3f MB" % (rdma / 1e6), out)
    assert "within the node (NVLink)" in out and "EP 16" in out
    assert re.search(r"dispatch .* -> bound\s+%.2f us \(bottleneck: rdma\)"
                     % expected["phases"]["dispatch"]["bound_us"], out)
    assert "D+C bound %.2f us" % expected["dc_bound_us"] in out
    assert "the guide's own measurement" in out and "whn09/ep-benchmarks-efa" in out and "2026-08-21" in out
    as_json = json.loads(cli("--nodes", "1", "--json").stdout)
    assert as_json["phases"]["dispatch"]["bytes_per_rank"]["rdma"] == 0


@pytest.mark.parametrize("args, says", [
    (["--nodes", "0"], r"--nodes: '0' is not an integer >= 1"),
    (["--dispatch-dtype", "fp4"], r"--dispatch-dtype: invalid choice: 'fp4' \(choose from "),
    (["--experts", "100"], r"--experts: .*a multiple of the 16 ranks"),
    (["--instance", "2xh200-lent"], r"--instance: .*an instance with EFA when nodes > 1"),
    (["--ranks-per-node", "16"], r"--ranks-per-node: .*at most the instance's 8 GPUs"),
])
def test_cli_refuses_bad_flags(args, says):
    done = cli(*args)
    assert done.returncode == 2 and done.stdout == ""
    assert re.search(says, done.stderr), done.stderr


def test_cli_measured_routing(tmp_path):
    recorded = tmp_path / "routing.json"
    ranks = [[10, 0, 0, 0]] * 4
    recorded.write_text(json.dumps({"rank_tokens": ranks}))
    args = ["--nodes", "2", "--ranks-per-node", "2", "--experts", "4", "--topk", "1",
            "--tokens", "10", "--hidden", "128", "--routing", str(recorded)]
    done = cli(*args)
    assert done.returncode == 0, done.stderr
    assert "measured routing" in done.stdout and "taken at their least" in done.stdout
    recorded.write_text(json.dumps({"rank_tokens": [[1, 2]]}))
    bad = cli(*args)
    assert bad.returncode == 2 and "--routing" in bad.stderr and "4 x 4" in bad.stderr
