"""What a training run's rank logs prove (stage 07): parsed from the lines lib.bench.moe_train
prints, gated here, pure (a replay re-computes every gate from the recorded logs).

`parse_ranks(text)` -> {rank: RankRecord}: each rank's `start`, `step`s, `efa` and `done` lines
(torchrun interleaves its ranks' output, so lines are found by their prefix and a flat JSON
object, wherever they sit on a line). `training_gates(ranks, ...)` -> the stage's gates:

- every rank started and ran to its last step (a `done` line; the ranks that did not, named)
- the dispatcher asked is the one every rank built (the class each logged)
- loss finite at every step, and lower after the last step than after the first
- grad norm finite at every step
- tokens cross ranks: at every step every rank's dispatcher sent tokens to other ranks, as many
  as its router's map routed there, and all ranks together received what they sent (SKIP at EP 1:
  every expert is on the one rank)
- the EFA write counters grew where the nodes expose them (SKIP where they do not)
- the same seed gave the same losses (when a second run is given: the determinism gate)
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from lib.bench.moe_train import LINE  # the prefix its ranks print (imports no torch at load)
from lib.core.evidence import Gate, gate, skip
from lib.engines.megatron import DISPATCHER_CLASSES

_RECORD = re.compile(rf"{LINE} (start|step|efa|done) (\{{[^{{}}]*\}})")


@dataclass
class RankRecord:
    rank: int
    start: dict | None = None
    steps: list[dict] = field(default_factory=list)
    efa: dict | None = None
    done: dict | None = None


def parse_ranks(text: str) -> dict[int, RankRecord]:
    """Every rank's records in `text` (one or more logs joined), by global rank."""
    ranks: dict[int, RankRecord] = {}
    for kind, body in _RECORD.findall(text):
        fields = json.loads(body)
        record = ranks.setdefault(int(fields["rank"]), RankRecord(int(fields["rank"])))
        if kind == "step":
            record.steps.append(fields)
        else:
            setattr(record, kind, fields)
    return dict(sorted(ranks.items()))


def losses(ranks: dict[int, RankRecord]) -> list[float]:
    """The loss per step (averaged over ranks by the ranks themselves; rank 0's record, else the
    lowest rank that logged steps)."""
    for record in ranks.values():
        if record.steps:
            return [s["loss"] for s in sorted(record.steps, key=lambda s: s["step"])]
    return []


def step_table(ranks: dict[int, RankRecord]) -> list[dict]:
    """One row per step: loss, grad norm, token copies sent across ranks (all ranks summed),
    the slowest rank's step seconds."""
    by_step: dict[int, list[dict]] = {}
    for record in ranks.values():
        for s in record.steps:
            by_step.setdefault(s["step"], []).append(s)
    return [{"step": step, "loss": rows[0]["loss"], "grad norm": rows[0]["grad_norm"],
             "sent to other ranks": sum(r["sent_to_other_ranks"] for r in rows),
             "routed to other ranks": sum(r["routed_to_other_ranks"] for r in rows),
             "ranks": len(rows), "step s (slowest rank)": max(r["step_s"] for r in rows)}
            for step, rows in sorted(by_step.items())]


def training_gates(ranks: dict[int, RankRecord], *, world: int, steps: int, dispatcher: str,
                   evidence: list[str], again: dict[int, RankRecord] | None = None,
                   efa_expected: bool = False) -> list[Gate]:
    gates = [_finished(ranks, world, steps, evidence), _dispatcher(ranks, dispatcher, evidence)]
    gates += _loss_gates(ranks, evidence)
    gates.append(_cross_rank(ranks, world, evidence))
    gates.append(_efa(ranks, efa_expected, evidence))
    if again is not None:
        gates.append(_deterministic(ranks, again, evidence))
    return gates


def _finished(ranks, world, steps, evidence) -> Gate:
    missing = [r for r in range(world) if r not in ranks or ranks[r].done is None]
    last = {r: len(ranks[r].steps) if r in ranks else 0 for r in missing}
    return gate("every rank ran every step", not missing,
                {"ranks done": world - len(missing), "world": world} if missing else
                f"{world} of {world} ranks, {steps} steps each",
                f"{world} ranks, each a 'done' line after {steps} steps",
                "" if not missing else "no 'done' line from rank(s) " + ", ".join(
                    f"{r} (steps logged: {last[r]})" for r in missing), evidence)


def _dispatcher(ranks, asked: str, evidence) -> Gate:
    want = DISPATCHER_CLASSES[asked]
    built = {r: (rec.start or {}).get("dispatchers") for r, rec in ranks.items()}
    wrong = {r: b for r, b in built.items() if b != [want]}
    return gate("the dispatcher asked is the one that ran", bool(built) and not wrong,
                want if built and not wrong else (wrong or "no 'start' line"),
                f"{want} (moe_token_dispatcher_type={asked!r}) in every MoE layer of every rank",
                "" if not wrong else "rank(s) " + ", ".join(
                    f"{r} built {b}" for r, b in wrong.items()), evidence)


def _loss_gates(ranks, evidence) -> list[Gate]:
    curve = losses(ranks)
    bad_loss = [(s["rank"], s["step"], s["loss"]) for rec in ranks.values() for s in rec.steps
                if not _finite(s["loss"])]
    bad_norm = [(s["rank"], s["step"], s["grad_norm"]) for rec in ranks.values()
                for s in rec.steps if not _finite(s["grad_norm"])]
    gates = [gate("loss finite at every step", bool(curve) and not bad_loss,
                  [round(x, 4) for x in curve] if not bad_loss else bad_loss[:4],
                  "a finite loss every step on every rank",
                  "" if curve and not bad_loss else
                  ("no step logged" if not curve else
                   "rank {} step {}: loss {}".format(*bad_loss[0])), evidence)]
    falls = len(curve) >= 2 and _finite(curve[0]) and _finite(curve[-1]) and curve[-1] < curve[0]
    gates.append(gate("loss lower after the last step than after the first", falls,
                      f"{curve[0]:.4f} -> {curve[-1]:.4f}" if len(curve) >= 2 else curve,
                      "last < first (two or more steps)", "", evidence))
    gates.append(gate("grad norm finite at every step", bool(curve) and not bad_norm,
                      [round(s["grad_norm"], 4) for s in sorted(
                          next(iter(ranks.values())).steps, key=lambda s: s["step"])]
                      if curve and not bad_norm else bad_norm[:4],
                      "a finite global gradient norm every step",
                      "" if not bad_norm else "rank {} step {}: grad norm {}".format(*bad_norm[0]),
                      evidence))
    return gates


def _cross_rank(ranks, world, evidence) -> Gate:
    name = "tokens cross ranks through the dispatcher at every step"
    if world == 1:
        return skip(name, "EP 1: every expert is on this rank, so no token crosses to another "
                          "(the dispatcher runs, its all-to-all moves nothing across ranks)",
                    evidence)
    rows = [s for rec in ranks.values() for s in rec.steps]
    short = [(s["rank"], s["step"], s["sent_to_other_ranks"], s["routed_to_other_ranks"])
             for s in rows if s["sent_to_other_ranks"] <= 0
             or s["sent_to_other_ranks"] != s["routed_to_other_ranks"]]
    by_step: dict[int, list[int]] = {}
    for s in rows:
        pair = by_step.setdefault(s["step"], [0, 0])
        pair[0] += s["sent_to_other_ranks"]
        pair[1] += s["received_from_other_ranks"]
    unbalanced = {k: v for k, v in by_step.items() if v[0] != v[1]}
    ok = bool(rows) and not short and not unbalanced
    reason = ""
    if short:
        reason = "rank {} step {}: the dispatcher sent {} token copies to other ranks, the router " \
                 "routed {} there".format(*short[0])
    elif unbalanced:
        step, (sent, got) = next(iter(unbalanced.items()))
        reason = f"step {step}: {sent} sent across ranks, {got} received"
    return gate(name, ok, {k: v[0] for k, v in sorted(by_step.items())} if ok else reason,
                "every rank sends > 0 token copies to other ranks each step, equal to what its "
                "router routed there; sent = received over all ranks", reason, evidence)


def _efa(ranks, expected: bool, evidence) -> Gate:
    name = "the all-to-all used the wire (EFA RDMA write bytes grew)"
    counters = [rec.efa for rec in ranks.values() if rec.efa]
    seen = [c for c in counters if c.get("write_bytes_before") is not None
            and c.get("write_bytes_after") is not None]
    if not seen:
        return skip(name, "no node exposes EFA counters here (the ranks' 'efa' lines read "
                          f"{counters[0]['counter'] if counters else 'nothing'})"
                          + ("" if not expected else ": on EFA nodes this is the evidence "
                                                     "the wire was used"), evidence)
    grew = {c["rank"]: c["write_bytes_after"] - c["write_bytes_before"] for c in seen}
    return gate(name, all(v > 0 for v in grew.values()), grew,
                "RDMA write bytes after > before on every node that reports them",
                "", evidence)


def _deterministic(ranks, again, evidence) -> Gate:
    first, second = losses(ranks), losses(again)
    return gate("the same seed gives the same losses (a second run)", bool(first)
                and first == second, {"first": first, "second": second} if first != second
                else f"{len(first)} losses equal", "the second run's losses equal the first's "
                "exactly", "", evidence)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
