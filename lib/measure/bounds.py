"""How close to the wire: a transfer-cost lower bound on one DeepEP V2 dispatch and one combine.

The bytes each rank moves follow DeepEP's own semantics (deepseek-ai/DeepEP, read in the stored
copies cited here):

- a token goes once per destination RANK, however many of its top-k experts live there
  (``deep_ep/buffers/elastic.py``, EPHandle: "A token is counted once per rank even if multiple
  of its top-k experts land on the same rank");
- across nodes, hybrid mode (``allow_hybrid_mode``, the default) sends a token over RDMA once per
  destination NODE, to the rank of the same local index there, which forwards it over NVLink;
  direct mode sends it over RDMA once per destination rank. This is the traffic model of
  ``ElasticBuffer.get_theoretical_num_sms`` (RDMA: expected scale-out top-k x (1 - 1/nodes);
  NVLink: 1 - 1/ranks-per-node of every token-rank pair; the local pair is a bypass);
- combine moves the same token counts back (``allow_multiple_reduction``, the default:
  tests/elastic/test_ep.py, "combine has exactly the same number of tokens as dispatch");
- bytes per token are test_ep.py's own count: the received x (FP8 with one fp32 scale per 128
  channels, or BF16), top-k indices (int64) and weights (fp32) for dispatch; BF16 x and the fp32
  top-k weights for combine.

Uniform random routing gives the expected counts (the probability that a token's top-k, drawn
without replacement, hits a group of experts is DeepEP's ``get_expected_topk``); a measured
routing is a matrix of tokens per (source rank, destination rank). The bound per phase is the
fixed cost of the links on the path plus the slowest link's bytes over its bandwidth, at the
rank that moves the most (sent or received). Link figures are data (links.yaml), each with its
source; the only fitted number, NVLink's per-phase fixed cost, is fitted on the guide's own
runs named there and shown by ``latency_fit``. What the model leaves out: BOUNDS.md.

What it is given is a shape and a place (03 at the stage's shape and place, the book's lines,
cited figures, a recorded run's cases, the command line), never a stage's parameters: a shape or
place outside the model (experts that do not divide over the ranks, more ranks than the
instance's GPUs, FP8 on a hidden size that is no multiple of 128) raises ValueError saying what
the model takes (``shape_problem``, ``place_problem``), which 03 shows as why it shows no bound;
the command line says the same of the flag that asked (argparse).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence, get_args

import numpy as np
import yaml

from lib.core.door import REPO_ROOT
from lib.engines.deepep import MODES, Mode  # noqa: F401  (MODES: bounds.MODES, as before)
from lib.measure.testep import first_case, parse_test_ep_log

LINKS_PATH = Path(__file__).with_name("links.yaml")
CITED_PATH = Path(__file__).with_name("cited_figures.yaml")
Phase = Literal["dispatch", "combine"]
DispatchDtype = Literal["fp8", "bf16"]
CombineDtype = Literal["bf16"]  # DeepEP combines BF16 only
PHASES: tuple[str, ...] = get_args(Phase)
DTYPES = {"dispatch": get_args(DispatchDtype), "combine": get_args(CombineDtype)}
DEFAULT_INSTANCE = "p5en.48xlarge"
# DeepEP V2's formats as test_ep.py counts them (count_bytes of recv_x, topk_idx, topk_weights):
ELEMENT_BYTES = {"fp8": 1, "bf16": 2}
FP8_SCALE_CHANNELS = 128  # per_token_cast_to_fp8: one scale per 128 channels ...
FP8_SCALE_BYTES = 4  # ... stored as fp32
TOPK_IDX_BYTES = 8  # deep_ep.topk_idx_t: torch.int64 (ElasticBuffer.dispatch docstring)
TOPK_WEIGHT_BYTES = 4  # torch.float


# ---- the shape -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    tokens: int  # per rank
    hidden: int
    topk: int
    experts: int
    ranks_per_node: int
    nodes: int
    dispatch_dtype: DispatchDtype = "fp8"
    combine_dtype: CombineDtype = "bf16"
    mode: Mode = "hybrid"

    @property
    def ranks(self) -> int:
        return self.ranks_per_node * self.nodes


# What the model cannot take: (the field, its value, what the model takes), or None
Problem = tuple[str, Any, str]


def outside(problem: Problem) -> str:
    """A problem as a ValueError says it: the field, its value, what the model takes."""
    name, value, takes = problem
    shown = repr(value)
    shown = shown if len(shown) <= 200 else shown[:197] + "..."
    return f"{name} = {shown} is outside the bound's model; it takes {takes}"


def shape_problem(*, tokens: int, hidden: int, topk: int, experts: int, ranks_per_node: int,
                  nodes: int, dispatch_dtype: DispatchDtype = "fp8") -> Problem | None:
    """The first field of a shape the model cannot take (None: it takes them all): counts of at
    least one, whole experts on every rank, top-k within the experts, and FP8's 128-channel
    scale blocks."""
    for name, value in (("tokens", tokens), ("hidden", hidden), ("topk", topk),
                        ("experts", experts), ("ranks_per_node", ranks_per_node),
                        ("nodes", nodes)):
        if value < 1:
            return name, value, "an integer >= 1"
    ranks = ranks_per_node * nodes
    if experts % ranks:
        return "experts", experts, (f"a multiple of the {ranks} ranks (DeepEP places experts / "
                                    "ranks experts on every rank)")
    if topk > experts:
        return "topk", topk, f"an integer from 1 to experts ({experts})"
    if dispatch_dtype == "fp8" and hidden % FP8_SCALE_CHANNELS:
        return "hidden", hidden, (f"a multiple of {FP8_SCALE_CHANNELS} for FP8 dispatch (one "
                                  "scale per 128 channels)")
    return None


def make_shape(*, tokens: int, hidden: int, topk: int, experts: int, ranks_per_node: int,
               nodes: int, dispatch_dtype: DispatchDtype = "fp8",
               combine_dtype: CombineDtype = "bf16", mode: Mode = "hybrid") -> Shape:
    """The Shape; ValueError naming the first field the model cannot take (shape_problem)."""
    problem = shape_problem(tokens=tokens, hidden=hidden, topk=topk, experts=experts,
                            ranks_per_node=ranks_per_node, nodes=nodes,
                            dispatch_dtype=dispatch_dtype)
    if problem:
        raise ValueError(outside(problem))
    return Shape(tokens, hidden, topk, experts, ranks_per_node, nodes, dispatch_dtype,
                 combine_dtype, mode)


def token_bytes(shape: Shape, phase: Phase) -> int:
    """Bytes one token carries in ``phase``, as test_ep.py counts them."""
    if phase == "dispatch":
        dtype = shape.dispatch_dtype
        scales = (shape.hidden // FP8_SCALE_CHANNELS * FP8_SCALE_BYTES) if dtype == "fp8" else 0
        return (shape.hidden * ELEMENT_BYTES[dtype] + scales
                + shape.topk * (TOPK_IDX_BYTES + TOPK_WEIGHT_BYTES))
    return shape.hidden * ELEMENT_BYTES[shape.combine_dtype] + shape.topk * TOPK_WEIGHT_BYTES


# ---- routing -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Routing:
    """Tokens per (source rank, destination rank), counted once per destination rank, and per
    (source rank, destination node): what hybrid mode sends over RDMA once per node."""
    rank_tokens: np.ndarray  # [ranks, ranks]
    node_tokens: np.ndarray  # [ranks, nodes]
    kind: str
    notes: tuple[str, ...] = ()


def hit_probability(experts: int, topk: int, group: int) -> float:
    """P(a token's top-k of ``experts``, drawn without replacement, hits a given ``group`` of
    experts at least once): DeepEP's get_expected_topk per group."""
    return 1.0 - math.comb(experts - group, topk) / math.comb(experts, topk)


def uniform_routing(shape: Shape) -> Routing:
    """Expected counts under uniform random routing."""
    p_rank = hit_probability(shape.experts, shape.topk, shape.experts // shape.ranks)
    p_node = hit_probability(shape.experts, shape.topk, shape.experts // shape.nodes)
    return Routing(np.full((shape.ranks, shape.ranks), shape.tokens * p_rank),
                   np.full((shape.ranks, shape.nodes), shape.tokens * p_node),
                   "uniform random routing (expected counts)")


def _matrix(name: str, value: Any, rows: int, cols: int) -> np.ndarray:
    try:
        array = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        array = None
    if array is None or array.shape != (rows, cols) or not np.isfinite(array).all() \
            or (array < 0).any():
        # name the matrix by its shape: a measured routing can be thousands of numbers
        shown = value if array is None else f"an array of shape {array.shape}"
        raise ValueError(outside((name, shown, f"a {rows} x {cols} matrix of token counts >= 0 "
                                               "(finite)")))
    return array


def measured_routing(shape: Shape, rank_tokens: Any, node_tokens: Any = None) -> Routing:
    """A routing a run recorded: ``rank_tokens[s][d]`` tokens of source rank s sent to
    destination rank d (once per rank), optionally ``node_tokens[s][n]`` tokens of s hitting
    node n. Without node_tokens, hybrid mode's RDMA count per node is taken at its least (the
    busiest destination rank of that node): the bound stays a lower bound, and says so."""
    ranks = _matrix("rank_tokens", rank_tokens, shape.ranks, shape.ranks)
    blocks = ranks.reshape(shape.ranks, shape.nodes, shape.ranks_per_node)
    least, most = blocks.max(axis=2), blocks.sum(axis=2)
    if node_tokens is None:
        return Routing(ranks, least, "measured routing",
                       ("per-node RDMA counts not recorded: taken at their least (the busiest "
                        "destination rank of each node)",))
    nodes = _matrix("node_tokens", node_tokens, shape.ranks, shape.nodes)
    if (nodes < least - 1e-9).any() or (nodes > most + 1e-9).any():
        raise ValueError(outside(("node_tokens", node_tokens, "for each (source, node) at least "
                                  "the busiest destination rank's count and at most their sum")))
    return Routing(ranks, nodes, "measured routing")


# ---- bytes per link ------------------------------------------------------------------------------
def dispatch_tokens(shape: Shape, routing: Routing) -> dict[str, np.ndarray]:
    """Per rank, the tokens dispatch moves: local (no link), NVLink and RDMA, sent and received."""
    R, L = shape.ranks, shape.ranks_per_node
    rank = np.arange(R)
    node, local = rank // L, rank % L
    M = routing.rank_tokens
    same_node = node[:, None] == node[None, :]
    intra = np.where(same_node & ~np.eye(R, dtype=bool), M, 0.0)
    counts = {"local": np.diag(M).copy(), "nvlink_send": intra.sum(1), "nvlink_recv": intra.sum(0)}
    if shape.mode == "direct" or shape.nodes == 1:
        cross = np.where(~same_node, M, 0.0)
        counts.update(rdma_send=cross.sum(1), rdma_recv=cross.sum(0))
        return counts
    # hybrid: s sends once per other node n, to the rank of its own local index there ...
    K = routing.node_tokens
    node_ids = np.arange(shape.nodes)
    remote = node_ids[None, :] != node[:, None]
    receiver = node_ids[None, :] * L + local[:, None]
    counts["rdma_send"] = np.where(remote, K, 0.0).sum(1)
    counts["rdma_recv"] = np.bincount(receiver[remote], weights=K[remote], minlength=R)
    # ... which forwards it over NVLink to every destination rank of that node but itself.
    forwarder = node[None, :] * L + local[:, None]
    hop = ~same_node & (forwarder != rank[None, :])
    counts["nvlink_send"] = counts["nvlink_send"] + np.bincount(
        forwarder[hop], weights=M[hop], minlength=R)
    counts["nvlink_recv"] = counts["nvlink_recv"] + np.where(hop, M, 0.0).sum(0)
    return counts


def phase_bytes(shape: Shape, routing: Routing | None = None) -> dict[str, dict[str, np.ndarray]]:
    """Per phase, per rank: bytes local / over NVLink / over RDMA, sent and received. Combine
    is dispatch reversed (same token counts, combine's bytes per token)."""
    routing = routing or uniform_routing(shape)
    tokens = dispatch_tokens(shape, routing)
    reverse = {"local": "local", "nvlink_send": "nvlink_recv", "nvlink_recv": "nvlink_send",
               "rdma_send": "rdma_recv", "rdma_recv": "rdma_send"}
    return {"dispatch": {k: v * token_bytes(shape, "dispatch") for k, v in tokens.items()},
            "combine": {k: tokens[reverse[k]] * token_bytes(shape, "combine") for k in tokens}}


# ---- link figures --------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _read_yaml(path: str) -> dict:
    with open(path) as fh:
        return yaml.safe_load(fh)


def load_links(path: str | Path = LINKS_PATH) -> dict:
    data = _read_yaml(str(path))
    for key in ("nvlink", "efa", "instances"):
        if not isinstance(data.get(key), dict):
            raise ValueError(f"{path}: no {key!r} table")
    return data


def nvlink_bandwidth(entry: Mapping) -> float:
    """GB/s per GPU: the best point of a measured curve (small sizes are latency-bound), or the
    single figure."""
    curve = entry.get("curve_GBps_by_MiB_per_rank")
    return float(max(curve.values())) if curve else float(entry["GBps"])


def efa_bandwidth(entry: Mapping) -> float:
    """GB/s per GPU: NICs x Gbit/s per NIC / 8 bits / GPUs per node."""
    return entry["nics_per_node"] * entry["Gbps_per_nic"] / 8 / entry["gpus_per_node"]


def link_figures(instance: str, links_path: str | Path = LINKS_PATH,
                 nvlink: str | None = None) -> dict[str, dict | None]:
    """The instance's NVLink and EFA figures: name, GBps, latency_us, source, date, basis.
    `nvlink` names another NVLink figure of links.yaml to use instead of the instance's (the
    wire's specification beside a measured curve: wire_nvlink). ValueError for an instance or
    a figure links.yaml does not hold (its data, not a parameter)."""
    links = load_links(links_path)
    if instance not in links["instances"]:
        raise ValueError(outside(("instance", instance, "an instance of links.yaml: "
                                  + ", ".join(links["instances"]))))
    machine = links["instances"][instance]
    name = nvlink or machine["nvlink"]
    if name not in links["nvlink"]:
        raise ValueError(outside(("nvlink", name, "an NVLink figure of links.yaml: "
                                  + ", ".join(links["nvlink"]))))
    nvl = links["nvlink"][name]
    figures: dict[str, dict | None] = {
        "nvlink": {"name": name, "GBps": nvlink_bandwidth(nvl),
                   "latency_us": _latency(name, nvl, links_path), "source": nvl["source"],
                   "date": nvl["date"], "basis": nvl["basis"], "note": machine.get("note", "")},
        "rdma": None}
    if machine.get("efa"):
        efa = links["efa"][machine["efa"]]
        figures["rdma"] = {"name": machine["efa"], "GBps": efa_bandwidth(efa), "latency_us": 0.0,
                           "source": efa["source"], "date": efa["date"], "basis": efa["what"],
                           "note": "no sourced per-message latency: bandwidth term only"}
    return {**figures, "instance": {"name": instance, **machine}}


def wire_nvlink(instance: str, links_path: str | Path = LINKS_PATH) -> str | None:
    """The NVLink figure of the wire itself (basis: specification) under the instance's NVLink
    figure, where that one is a measured curve naming its `specification`; None elsewhere."""
    links = load_links(links_path)
    machine = links["instances"].get(instance) or {}
    entry = links["nvlink"].get(machine.get("nvlink"), {})
    wire = entry.get("specification")
    return wire if wire in links["nvlink"] else None


def link_label(figures: Mapping, link: str, links_path: str | Path = LINKS_PATH) -> str:
    """What bounds a phase whose bottleneck is `link` ("nvlink" or "rdma"), in the few words a
    plot's legend carries: an NVLink figure's `label` (a measured curve says it is NCCL's floor
    measured here, not the wire), or the EFA NICs' specification."""
    if link == "nvlink":
        name = figures["nvlink"]["name"]
        entry = load_links(links_path)["nvlink"][name]
        return f"{entry.get('label') or 'NVLink ' + name} ({figures['nvlink']['GBps']:g} GB/s " \
               "per GPU per direction)"
    efa = load_links(links_path)["efa"][figures["rdma"]["name"]]
    return (f"the wire, EFA: {efa['nics_per_node']} x {efa['Gbps_per_nic']} Gbit/s per node "
            f"({efa_bandwidth(efa):g} GB/s per GPU)")


def _latency(name: str, entry: Mapping, links_path: str | Path) -> float:
    if entry.get("latency") == "fit":
        return latency_fit(name, links_path)["latency_us"]
    return 0.0


# ---- the bound -----------------------------------------------------------------------------------
def transfer_us(nbytes: float, gbps: float) -> float:
    return nbytes / (gbps * 1e3)  # bytes / (GB/s x 1e9) in seconds, x 1e6 in microseconds


def place_problem(shape: Shape, figures: Mapping) -> Problem | None:
    """What of the place the instance's figures cannot bound (None: nothing): nodes without EFA,
    more ranks per node than the instance has GPUs."""
    if shape.nodes > 1 and figures["rdma"] is None:
        return "instance", figures["instance"]["name"], "an instance with EFA when nodes > 1"
    if shape.ranks_per_node > figures["instance"]["gpus_per_node"]:
        return "ranks_per_node", shape.ranks_per_node, (
            f"at most the instance's {figures['instance']['gpus_per_node']} GPUs per node")
    return None


def phase_bounds(shape: Shape, figures: Mapping, routing: Routing | None = None,
                 with_latency: bool = True) -> dict[str, dict]:
    """Per phase: the worst rank's bytes per link, each link's transfer time, the latency term,
    the bound (latency + the slowest link's time: NVLink and RDMA overlap) and its bottleneck.
    ValueError for a place the figures cannot bound (place_problem)."""
    problem = place_problem(shape, figures)
    if problem:
        raise ValueError(outside(problem))
    result = {}
    for phase, per_rank in phase_bytes(shape, routing).items():
        worst = {link: float(max(per_rank[f"{link}_send"].max(), per_rank[f"{link}_recv"].max()))
                 for link in ("nvlink", "rdma")}
        times = {link: transfer_us(worst[link], figures[link]["GBps"]) if worst[link] else 0.0
                 for link in worst}
        latency = 0.0
        if with_latency:
            latency = figures["nvlink"]["latency_us"] + (
                figures["rdma"]["latency_us"] if shape.nodes > 1 else 0.0)
        bottleneck = max(times, key=times.get)
        result[phase] = {"bytes_per_rank": worst, "local_bytes": float(per_rank["local"].max()),
                         "transfer_us": times, "latency_us": latency,
                         "bound_us": latency + times[bottleneck], "bottleneck": bottleneck}
    return result


def bound(shape: Shape, instance: str = DEFAULT_INSTANCE, routing: Routing | None = None,
          links_path: str | Path = LINKS_PATH, nvlink: str | None = None) -> dict[str, Any]:
    """The whole answer at a shape: bytes, per-phase bounds, D+C bound, the figures used
    (`nvlink`: another NVLink figure than the instance's, as link_figures takes it)."""
    figures = link_figures(instance, links_path, nvlink)
    routing = routing or uniform_routing(shape)
    phases = phase_bounds(shape, figures, routing)
    return {"shape": shape, "routing": routing.kind, "routing_notes": list(routing.notes),
            "token_bytes": {p: token_bytes(shape, p) for p in PHASES}, "phases": phases,
            "dc_bound_us": sum(phases[p]["bound_us"] for p in PHASES), "figures": figures}


# ---- the latency fit: on the guide's own runs only -----------------------------------------------
def guide_cases(run: str | Path) -> list[dict]:
    """The first test_ep case of every test_ep call a committed run recorded, by token count."""
    run_dir = Path(run) if Path(run).is_absolute() else REPO_ROOT / run
    _refuse_unmeasured(run_dir)
    calls = run_dir / "calls" / "03_kernel_test"
    if not calls.is_dir():
        raise FileNotFoundError(f"no 03_kernel_test calls in {run_dir}")
    cases = []
    for stdout in sorted(calls.glob("*.stdout")):
        try:
            cases.append({**first_case(parse_test_ep_log(stdout)), "log": str(stdout)})
        except ValueError:
            continue  # another call of 03 (the torch benchmark): no test_ep lines
    if not cases:
        raise ValueError(f"{calls}: no test_ep output among the recorded calls")
    return sorted(cases, key=lambda c: c["num_tokens"])


# A run whose level says so carries logs composed from others' (the kube control plane's
# simulated nodes replay 2x H200 output under 16 rank labels): neither a fit nor a check.
UNMEASURED_LEVEL_WORDS = ("simulated", "not a measurement")


def _refuse_unmeasured(run_dir: Path) -> None:
    record = run_dir / "run.json"
    level = json.loads(record.read_text()).get("level", "") if record.is_file() else ""
    if not is_measurement(level):
        raise ValueError(f"{run_dir}: not a measurement of any hardware (run.json level: "
                         f"{level!r}); a bound is fitted and checked on measured runs only")


def shape_of_case(case: Mapping, nodes: int = 1, mode: str = "hybrid") -> Shape:
    """The shape test_ep ran: its Config block and first case (FP8 dispatch or not)."""
    fp8 = case["params"].get("use_fp8_dispatch", 1) == 1
    return make_shape(tokens=case["num_tokens"], hidden=case["hidden"], topk=case["num_topk"],
                      experts=case["num_experts"], ranks_per_node=case["num_ranks"] // nodes,
                      nodes=nodes, dispatch_dtype="fp8" if fp8 else "bf16", mode=mode)


@functools.lru_cache(maxsize=None)
def _fit(name: str, links_path: str) -> dict:
    links = load_links(links_path)
    entry = links["nvlink"][name]
    figures = {"nvlink": {"GBps": nvlink_bandwidth(entry)}, "rdma": None,
               "instance": {"name": name, "gpus_per_node": math.inf}}
    points = []
    for run in entry["fit_runs"]:
        for case in guide_cases(run):
            shape = shape_of_case(case)
            transfer = phase_bounds(shape, figures, with_latency=False)
            for phase in PHASES:
                measured = case["phases_us"][phase]["p50"]
                points.append({"run": run, "tokens": shape.tokens, "phase": phase,
                               "measured_us": measured,
                               "transfer_us": transfer[phase]["bound_us"],
                               "residual_us": measured - transfer[phase]["bound_us"]})
    residuals = [p["residual_us"] for p in points]
    return {"link": name, "GBps": figures["nvlink"]["GBps"], "runs": list(entry["fit_runs"]),
            "latency_us": max(0.0, min(residuals)),
            "mean_residual_us": sum(residuals) / len(residuals), "points": points,
            "method": "lower envelope: the least of (measured p50 - bytes / bandwidth) over every "
                      "dispatch and combine of the runs named, so no fitted point lies below "
                      "the bound; mean_residual_us is the least-squares intercept at that "
                      "bandwidth, shown, not used"}


def latency_fit(name: str = "h200-nccl-2gpu", links_path: str | Path = LINKS_PATH) -> dict:
    """The NVLink per-phase fixed cost, fitted on the guide's own runs that links.yaml names
    (fit_runs) and nothing else; with every point, its residual and the method. ValueError for
    a figure links.yaml does not fit."""
    nvlink = load_links(links_path)["nvlink"]
    if nvlink.get(name, {}).get("latency") != "fit":
        fitted = [k for k, v in nvlink.items() if v.get("latency") == "fit"]
        raise ValueError(outside(("name", name, "a fitted NVLink figure of links.yaml: "
                                  + (", ".join(fitted) or "(none is fitted)"))))
    return _fit(name, str(links_path))


# ---- checked against what was measured -----------------------------------------------------------
TABLE_COLUMNS = ("figure", "kind", "instance", "nodes", "ranks_per_node", "tokens",
                 "dispatch_dtype", "phase", "bound_us", "measured_us", "ratio", "bottleneck",
                 "fitted_on", "source", "date", "note")


def load_cited(path: str | Path = CITED_PATH) -> dict:
    data = _read_yaml(str(path))
    for key in ("guide_runs", "cited"):
        if not isinstance(data.get(key), list):
            raise ValueError(f"{path}: no {key!r} list")
    return data


def _rows(figure: str, shape: Shape, instance: str, measured: Mapping[str, float],
          common: Mapping, links_path: str | Path) -> list[dict]:
    """One row per measured phase (dispatch, combine, dc): bound, measured, measured / bound."""
    answer = bound(shape, instance, links_path=links_path)
    bounds = {p: answer["phases"][p]["bound_us"] for p in PHASES}
    bounds["dc"] = answer["dc_bound_us"]
    rows = []
    for phase in ("dispatch", "combine", "dc"):
        if phase not in measured:
            continue
        bottleneck = answer["phases"][phase]["bottleneck"] if phase in PHASES else " / ".join(
            answer["phases"][p]["bottleneck"] for p in PHASES)
        rows.append({"figure": figure, "instance": instance, "nodes": shape.nodes,
                     "ranks_per_node": shape.ranks_per_node, "tokens": shape.tokens,
                     "dispatch_dtype": shape.dispatch_dtype, "phase": phase,
                     "bound_us": bounds[phase], "measured_us": float(measured[phase]),
                     "ratio": float(measured[phase]) / bounds[phase], "bottleneck": bottleneck,
                     **common})
    return rows


def _guide_rows(entry: Mapping, fitted_runs: set[str], links_path) -> list[dict]:
    rows = []
    for case in guide_cases(entry["run"]):
        shape = shape_of_case(case, nodes=entry.get("nodes", 1),
                              mode=entry.get("mode", "hybrid"))
        measured = {p: case["phases_us"][p]["p50"] for p in PHASES}
        measured["dc"] = case["dc_p50_us"]
        fitted = Path(entry["run"]).name in {Path(run).name for run in fitted_runs}
        common = {"kind": "guide run", "fitted_on": fitted,
                  "source": f"{entry['run']} ({Path(case['log']).name}, test_ep p50 over "
                            f"{case['num_ranks']} ranks)", "date": entry["date"],
                  "note": entry["what"]}
        rows += _rows(f"{Path(entry['run']).name} {shape.tokens} tokens", shape,
                      entry["instance"], measured, common, links_path)
    return rows


def run_rows(run_dir: str | Path, instance: str, date: str, what: str, nodes: int = 1,
             links_path: str | Path = LINKS_PATH) -> list[dict]:
    """A committed run's test_ep first cases (every token count it recorded) beside their
    bounds: checked_table's rows for one run, 'fitted_on' saying whether links.yaml fitted the
    NVLink latency on it. ValueError for a run whose level says it measured nothing."""
    fitted_runs = {run for entry in load_links(links_path)["nvlink"].values()
                   for run in entry.get("fit_runs", [])}
    return _guide_rows({"run": str(run_dir), "instance": instance, "date": date, "what": what,
                        "nodes": nodes}, fitted_runs, links_path)


def cited_rows(cited_path: str | Path = CITED_PATH,
               links_path: str | Path = LINKS_PATH) -> list[dict]:
    """checked_table's rows of the figures others measured (cited_figures.yaml `cited`)."""
    rows: list[dict] = []
    for entry in load_cited(cited_path)["cited"]:
        rows += _cited_rows(entry, links_path)
    return rows


def _cited_rows(entry: Mapping, links_path) -> list[dict]:
    shape = make_shape(tokens=entry["tokens"], hidden=entry["hidden"], topk=entry["topk"],
                       experts=entry["experts"], ranks_per_node=entry["ranks_per_node"],
                       nodes=entry["nodes"], dispatch_dtype=entry["dispatch_dtype"],
                       mode=entry.get("mode", "hybrid"))
    note = entry["what"] + (f"; assumed: {entry['assumed']}" if entry.get("assumed") else "")
    common = {"kind": "cited", "fitted_on": False, "source": entry["source"],
              "date": entry["date"], "note": note}
    return _rows(entry["id"], shape, entry["instance"], entry["phases"], common, links_path)


def checked_table(cited_path: str | Path = CITED_PATH,
                  links_path: str | Path = LINKS_PATH) -> "pd.DataFrame":
    """Every figure beside its bound: bound_us, measured_us, ratio = measured / bound (>= 1 for
    a true lower bound), the bottleneck link, and whether the row's run is one the latency term
    was fitted on (fitted_on; the guide rows of cited_figures.yaml are not)."""
    import pandas as pd

    cited = load_cited(cited_path)
    links = load_links(links_path)
    fitted_runs = {run for entry in links["nvlink"].values() for run in entry.get("fit_runs", [])}
    rows: list[dict] = []
    for entry in cited["guide_runs"]:
        rows += _guide_rows(entry, fitted_runs, links_path)
    for entry in cited["cited"]:
        rows += _cited_rows(entry, links_path)
    return pd.DataFrame(rows, columns=list(TABLE_COLUMNS))


# ---- the bound at a stage's shape and place (03's table, plan's prediction, the book) ---------
def local_instance(links_path: str | Path = LINKS_PATH) -> str:
    """The instance links.yaml bounds a local-context run with (`local_machine`)."""
    links = load_links(links_path)
    name = links.get("local_machine")
    if name not in links["instances"]:
        raise ValueError(f"{links_path}: local_machine {name!r} is not one of its instances")
    return name


def is_measurement(level: str | None) -> bool:
    """False for a run whose level says its figures measured no hardware (simulated nodes
    replaying others' logs): a figure beside a bound must be a measurement of that place."""
    return not any(word in (level or "") for word in UNMEASURED_LEVEL_WORDS)


def tokens_bounds(token_counts: Sequence[int], *, hidden: int, topk: int, experts: int,
                  ranks_per_node: int, nodes: int, instance: str,
                  dispatch_dtype: DispatchDtype = "fp8", mode: Mode = "hybrid",
                  links_path: str | Path = LINKS_PATH,
                  nvlink: str | None = None) -> dict[str, Any]:
    """The bound at each of one or more token counts of one place: per phase, D+C and the
    bottleneck, with the place (EP, instance, mode), the link sources said and `label`, what
    bounds it in a few words (link_label of the bottleneck at the most tokens). ValueError for
    a shape or place outside the model (experts not divisible by the ranks, more ranks than the
    instance has). `nvlink`: another NVLink figure than the instance's (the wire's:
    wire_nvlink)."""
    rows, answer = [], None
    for tokens in token_counts:
        shape = make_shape(tokens=tokens, hidden=hidden, topk=topk, experts=experts,
                           ranks_per_node=ranks_per_node, nodes=nodes,
                           dispatch_dtype=dispatch_dtype, mode=mode)
        answer = bound(shape, instance, links_path=links_path, nvlink=nvlink)
        phases = answer["phases"]
        rows.append({"tokens": tokens, "dispatch bound (us)": phases["dispatch"]["bound_us"],
                     "combine bound (us)": phases["combine"]["bound_us"],
                     "D+C bound (us)": answer["dc_bound_us"],
                     "bottleneck D / C": " / ".join(phases[p]["bottleneck"] for p in PHASES)})
    if answer is None:
        raise ValueError(outside(("token_counts", list(token_counts), "one or more token counts")))
    fitted = [run for entry in load_links(links_path)["nvlink"].values()
              for run in entry.get("fit_runs", [])]
    return {"instance": instance, "ep": ranks_per_node * nodes, "nodes": nodes,
            "ranks_per_node": ranks_per_node, "mode": mode, "routing": answer["routing"],
            "dispatch_dtype": dispatch_dtype, "rows": rows, "fitted_on": fitted,
            "sources": _source_lines(answer["figures"], nodes > 1),
            "nvlink": answer["figures"]["nvlink"]["name"],
            "label": link_label(answer["figures"], answer["phases"]["combine"]["bottleneck"],
                                links_path)}


def describe_place(bounds_at: Mapping) -> str:
    """One line naming the place and shape a tokens_bounds answer is for."""
    nodes = bounds_at["nodes"]
    where = (f"{nodes} nodes x {bounds_at['ranks_per_node']} GPUs" if nodes > 1
             else f"{bounds_at['ranks_per_node']} GPUs of one node")
    return (f"EP {bounds_at['ep']} ({where}, {bounds_at['instance']}), {bounds_at['mode']} mode, "
            f"{bounds_at['dispatch_dtype']} dispatch / bf16 combine, {bounds_at['routing']}")


def ratio(measured: float | None, bound_us: float | None) -> float | None:
    """measured / bound (>= 1 where the bound holds); None when either is missing."""
    if measured is None or bound_us is None or bound_us <= 0:
        return None
    return float(measured) / float(bound_us)


# ---- the command line ----------------------------------------------------------------------------
def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:9.3f} MB"


def format_report(answer: Mapping) -> str:
    """The CLI's text: bytes per rank within and across nodes, the bound per phase, sources."""
    s, f, ph = answer["shape"], answer["figures"], answer["phases"]
    lines = [f"DeepEP V2 dispatch/combine transfer bound: {s.nodes} node(s) x {s.ranks_per_node} "
             f"ranks (EP {s.ranks}) on {f['instance']['name']}, {s.mode} mode",
             f"shape: {s.tokens} tokens per rank, hidden {s.hidden}, top-{s.topk} of {s.experts} "
             f"experts; dispatch {s.dispatch_dtype} ({answer['token_bytes']['dispatch']} bytes per "
             f"token), combine {s.combine_dtype} ({answer['token_bytes']['combine']} bytes per token)",
             f"routing: {answer['routing']}", *[f"  note: {n}" for n in answer["routing_notes"]],
             "bytes per rank (the busiest rank, sent or received):",
             f"  {'':34}{'dispatch':>14}{'combine':>14}",
             f"  {'on the rank itself (no link)':34}" + "".join(
                 f"{_mb(ph[p]['local_bytes']):>14}" for p in PHASES),
             f"  {'within the node (NVLink)':34}" + "".join(
                 f"{_mb(ph[p]['bytes_per_rank']['nvlink']):>14}" for p in PHASES),
             f"  {'across nodes (RDMA/EFA)':34}" + "".join(
                 f"{_mb(ph[p]['bytes_per_rank']['rdma']):>14}" for p in PHASES),
             "bound per phase (latency + the slowest link; NVLink and RDMA overlap):"]
    for p in PHASES:
        t = ph[p]["transfer_us"]
        lines.append(f"  {p:9} NVLink {t['nvlink']:8.2f} us, RDMA {t['rdma']:8.2f} us, latency "
                     f"{ph[p]['latency_us']:6.2f} us -> bound {ph[p]['bound_us']:8.2f} us "
                     f"(bottleneck: {ph[p]['bottleneck']})")
    lines += [f"  D+C bound {answer['dc_bound_us']:.2f} us", "sources:"]
    lines += _source_lines(f, s.nodes > 1)
    return "\n".join(lines)


def _source_lines(figures: Mapping, across_nodes: bool) -> list[str]:
    nvl, rdma = figures["nvlink"], figures["rdma"]
    lines = [f"  NVLink {nvl['name']}: {nvl['GBps']:g} GB/s per GPU ({nvl['basis']}); "
             f"{nvl['source']}, {nvl['date']}"]
    if nvl["note"]:
        lines.append(f"    {nvl['note']}")
    lines.append(f"  NVLink latency {nvl['latency_us']:.2f} us per phase: " + (
        "fitted on the guide's own runs (lib.measure.bounds.latency_fit)" if nvl["latency_us"]
        else "no sourced figure (0)"))
    if across_nodes and rdma:
        lines.append(f"  RDMA {rdma['name']}: {rdma['GBps']:g} GB/s per GPU ({rdma['basis']}); "
                     f"{rdma['source']}, {rdma['date']}; {rdma['note']}")
    return lines


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lib.measure.bounds",
                                     description="Bytes per rank and a lower bound on the time "
                                     "of one DeepEP V2 dispatch and one combine.")
    for flag, default, what in (("--tokens", 128, "tokens per rank"), ("--hidden", 7168, "hidden"),
                                ("--topk", 8, "experts per token"), ("--experts", 256, "experts"),
                                ("--ranks-per-node", 8, "ranks (GPUs) per node"),
                                ("--nodes", 2, "nodes")):
        parser.add_argument(flag, type=_positive_int, default=default, help=f"{what} ({default})")
    parser.add_argument("--dispatch-dtype", choices=DTYPES["dispatch"], default="fp8")
    parser.add_argument("--combine-dtype", choices=DTYPES["combine"], default="bf16")
    parser.add_argument("--mode", choices=MODES, default="hybrid")
    parser.add_argument("--instance", choices=list(load_links()["instances"]),
                        default=DEFAULT_INSTANCE)
    parser.add_argument("--routing", type=Path, help="a JSON file with rank_tokens "
                        "[source rank][destination rank] (and optionally node_tokens)")
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")
    return parser


def _refuse(parser: argparse.ArgumentParser, problem: Problem) -> None:
    """parser.error naming the flag that asked and what the model takes (exit 2)."""
    name, value, takes = problem
    parser.error(f"argument --{name.replace('_', '-')}: {value!r} is not allowed; allowed: "
                 f"{takes}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    given = dict(tokens=args.tokens, hidden=args.hidden, topk=args.topk, experts=args.experts,
                 ranks_per_node=args.ranks_per_node, nodes=args.nodes,
                 dispatch_dtype=args.dispatch_dtype)
    problem = shape_problem(**given)
    if problem:
        _refuse(parser, problem)
    shape = make_shape(**given, combine_dtype=args.combine_dtype, mode=args.mode)
    problem = place_problem(shape, link_figures(args.instance))
    if problem:
        _refuse(parser, problem)
    routing = None
    if args.routing:
        try:
            recorded = json.loads(args.routing.read_text())
        except (OSError, json.JSONDecodeError) as error:
            parser.error(f"argument --routing: cannot read {args.routing}: {error}")
        try:
            routing = measured_routing(shape, recorded.get("rank_tokens"),
                                       recorded.get("node_tokens"))
        except ValueError as error:
            parser.error(f"argument --routing: {error}")
    answer = bound(shape, args.instance, routing)
    print(json.dumps(_jsonable(answer), indent=2) if args.json else format_report(answer))
    return 0


def _jsonable(value: Any) -> Any:
    if isinstance(value, Shape):
        return {k: getattr(value, k) for k in value.__dataclass_fields__}
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and math.isinf(value):
        return None
    return value


if __name__ == "__main__":
    sys.exit(main())
