"""07: megatron-core trains a small MoE GPT over two real ranks (gloo, EP 2) on this CPU.

The stage runs once for real (torchrun twice: the run and its determinism repeat, ~20 s); its
recorded rank logs then feed the FAIL paths, each a real log with one thing changed: a loss
that goes NaN, a grad norm that does, a dispatcher other than the one asked, a rank that stops
logging before its last step, a dispatcher that sends fewer tokens than its router routed."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lib.core.door import REPO_ROOT, Door
from lib.core.errors import ParameterError
from lib.core.stage import Stage
from lib.engines import megatron
from lib.measure import training
from lib.roots import pins
from lib.stages import registry, train


def make_stage(run_dir: Path, **given) -> Stage:
    return Stage("07_train", registry.resolve("07_train", given), run_dir,
                 Door(run_dir, "07_train"), None)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The stage run for real on this machine's CPU: its data, gates and rank logs."""
    run_dir = tmp_path_factory.mktemp("train") / "run"
    stage = make_stage(run_dir)
    data = train.run(stage)
    gates = {g.gate: g for g in stage.gates}
    logs = "\n".join(p.read_text() for p in sorted((run_dir / "calls" / "07_train")
                                                     .glob("*.stdout")))
    return data, gates, logs


def by_name(gates) -> dict:
    return {g.gate: g for g in gates}


def test_two_ranks_train_and_every_gate_passes(trained):
    data, gates, _ = trained
    assert {n: g.status for n, g in gates.items()} == {
        "every rank exits 0": "PASS", "every rank ran every step": "PASS",
        "the dispatcher asked is the one that ran": "PASS",
        "loss finite at every step": "PASS",
        "loss lower after the last step than after the first": "PASS",
        "grad norm finite at every step": "PASS",
        "tokens cross ranks through the dispatcher at every step": "PASS",
        "the all-to-all used the wire (EFA RDMA write bytes grew)": "SKIP",
        "the same seed gives the same losses (a second run)": "PASS"}
    steps = data["steps"]
    assert [s["step"] for s in steps] == list(range(5)) and data["world"] == 2
    assert steps[-1]["loss"] < steps[0]["loss"]
    # synthetic tokens over 128 ids start near ln(128) = 4.85 with random weights
    assert 4.5 < steps[0]["loss"] < 5.3
    # 2 ranks x 4 sequences x 32 tokens x top-2 = 512 token copies per layer, ~half of them
    # to the other rank's 4 experts; 2 layers
    for s in steps:
        assert s["sent to other ranks"] == s["routed to other ranks"]
        assert 2 * 512 * 0.3 < s["sent to other ranks"] < 2 * 512 * 0.7
    assert gates["the dispatcher asked is the one that ran"].observed == \
        "MoEAlltoAllTokenDispatcher"


def test_every_rank_logs_the_shims_it_needed_and_its_own_experts(trained):
    ranks = training.parse_ranks(trained[2])
    assert sorted(ranks) == [0, 1]
    assert ranks[0].start["local_experts"] == [0, 1, 2, 3]
    assert ranks[1].start["local_experts"] == [4, 5, 6, 7]
    assert "moe_utils.te_general_gemm = None (no Transformer Engine)" in ranks[0].start["shims"]
    assert ranks[0].efa["write_bytes_before"] is None  # no EFA device on this machine


def gates_of(text: str, **kw) -> dict:
    return by_name(training.training_gates(training.parse_ranks(text), world=2, steps=5,
                                           dispatcher=kw.pop("dispatcher", "alltoall"),
                                           evidence=["x.log"], **kw))


def one_run(logs: str) -> str:
    """The first of the two recorded runs (each rank's lines once)."""
    first_done = [m.end() for m in re.finditer(r'moe-train done \{[^}]*\}', logs)][1]
    return logs[:first_done]


def test_a_loss_that_goes_nan_fails_naming_the_rank_and_step(trained):
    text = re.sub(r'("loss": )[0-9.]+(, "rank": 1, [^}]*"step": 3)', r"\1NaN\2",
                  one_run(trained[2]))
    gates = gates_of(text)
    loss = gates["loss finite at every step"]
    assert loss.status == "FAIL" and loss.reason == "rank 1 step 3: loss nan"
    assert gates["grad norm finite at every step"].status == "PASS"


def test_a_grad_norm_that_goes_infinite_fails(trained):
    text = re.sub(r'"grad_norm": [0-9.]+(, "loss": [0-9.]+, "rank": 0, [^}]*"step": 2)',
                  r'"grad_norm": Infinity\1', one_run(trained[2]))
    norm = gates_of(text)["grad norm finite at every step"]
    assert norm.status == "FAIL" and norm.reason == "rank 0 step 2: grad norm inf"


def test_a_dispatcher_other_than_the_one_asked_fails(trained):
    text = one_run(trained[2]).replace('"dispatchers": ["MoEAlltoAllTokenDispatcher"], '
                                       '"ep_size": 2, "local_experts": [4',
                                       '"dispatchers": ["MoEAllGatherTokenDispatcher"], '
                                       '"ep_size": 2, "local_experts": [4')
    gate = gates_of(text)["the dispatcher asked is the one that ran"]
    assert gate.status == "FAIL"
    assert gate.reason == "rank(s) 1 built ['MoEAllGatherTokenDispatcher']"
    # asked for allgather, the real log (alltoall on both ranks) fails on both
    asked = gates_of(one_run(trained[2]), dispatcher="allgather")[
        "the dispatcher asked is the one that ran"]
    assert asked.status == "FAIL" and asked.reason.startswith("rank(s) 0 built")


def test_a_rank_that_stops_before_its_last_step_is_named(trained):
    ranks = training.parse_ranks(one_run(trained[2]))
    ranks[1].steps, ranks[1].done = ranks[1].steps[:3], None  # its lines end after step 2
    finished = by_name(training.training_gates(ranks, world=2, steps=5, dispatcher="alltoall",
                                               evidence=[]))["every rank ran every step"]
    assert finished.status == "FAIL"
    assert finished.reason == "no 'done' line from rank(s) 1 (steps logged: 3)"


def test_a_dispatcher_that_sends_less_than_its_router_routed_fails(trained):
    text = re.sub(r'("rank": 0, "received_from_other_ranks": \d+, "routed_to_other_ranks": )(\d+)'
                  r'(, "sent_to_other_ranks": )\d+(, "step": 1,)',
                  lambda m: f"{m[1]}{m[2]}{m[3]}{int(m[2]) - 7}{m[4]}", one_run(trained[2]))
    gate = gates_of(text)["tokens cross ranks through the dispatcher at every step"]
    assert gate.status == "FAIL"
    assert re.fullmatch(r"rank 0 step 1: the dispatcher sent (\d+) token copies to other ranks, "
                        r"the router routed (\d+) there", gate.reason)
    sent, routed = map(int, re.findall(r"\d+", gate.reason)[2:4])
    assert routed - sent == 7


def test_different_losses_on_the_second_run_fail_the_determinism_gate(trained):
    first = one_run(trained[2])
    # rank 0's first loss (the ranks log the same mean loss; rank 0's is the curve) one digit off
    second = re.sub(r'("loss": \d\.)(\d)(\d*, "rank": 0, )',
                    lambda m: m[1] + str((int(m[2]) + 1) % 10) + m[3], first, 1)
    gate = gates_of(first, again=training.parse_ranks(second))[
        "the same seed gives the same losses (a second run)"]
    assert gate.status == "FAIL" and gate.observed["first"] != gate.observed["second"]


def test_ep_1_says_no_token_crosses(trained):
    rank0 = "\n".join(m[0] for m in re.finditer(r'moe-train \w+ \{[^}]*"rank": 0[,}][^}]*\}?',
                                                 one_run(trained[2])))
    gate = by_name(training.training_gates(training.parse_ranks(rank0), world=1, steps=5,
                                           dispatcher="alltoall", evidence=[]))[
        "tokens cross ranks through the dispatcher at every step"]
    assert gate.status == "SKIP" and gate.reason.startswith("EP 1: every expert is on this rank")


def test_efa_counters_that_grew_pass_and_that_did_not_fail(trained):
    ranks = training.parse_ranks(one_run(trained[2]))
    ranks[0].efa.update(write_bytes_before=1000, write_bytes_after=1_097_000_000)
    ranks[1].efa.update(write_bytes_before=5000, write_bytes_after=5000)
    gate = by_name(training.training_gates(ranks, world=2, steps=5, dispatcher="alltoall",
                                           evidence=[], efa_expected=True))[
        "the all-to-all used the wire (EFA RDMA write bytes grew)"]
    assert gate.status == "FAIL" and gate.observed == {0: 1_096_999_000, 1: 0}


# ---- parameters: refused before anything runs ------------------------------------------------
@pytest.mark.parametrize("given, name, allowed", [
    ({"train_topk": 9}, "train_topk", "an integer from 1 to train_experts (8)"),
    ({"train_experts": 7}, "train_experts", "a multiple of the ranks (2: EP spans every rank)"),
    ({"train_hidden": 66}, "train_hidden", "a multiple of train_heads (4)"),
    ({"train_dispatcher": "flex"}, "train_dispatcher", "alltoall or allgather: megatron-core "
                                                       "0.16.1 has no DeepEP-V2"),
    ({"train_dispatcher": "deepep"}, "train_dispatcher", "one of alltoall, allgather, flex"),
    ({"train_lr": 2.0}, "train_lr", "a learning rate"),
    ({"train_steps": 1}, "train_steps", "an integer >= 2 and <= 1000"),
])
def test_bad_training_parameters_are_refused_naming_the_parameter(given, name, allowed):
    with pytest.raises(ParameterError) as err:
        registry.resolve("07_train", given)
    assert err.value.name == name and allowed in str(err.value)


def test_the_pinned_release_is_the_one_requirements_install():
    version = pins.load()["pins"][megatron.PIN]["version"]
    lines = (REPO_ROOT / "requirements.txt").read_text().splitlines()
    assert f"megatron-core=={version}" in lines
    from importlib.metadata import version as installed
    assert installed("megatron-core") == version


def test_torchrun_argv_carries_the_shape_and_the_rendezvous():
    class Planned:
        params = registry.resolve("07_train", {"context": "plan", "nodes": 2})
    cfg = train.train_config(Planned(), gpus=8)
    argv = megatron.train_argv(cfg, nodes=2, node_rank=1, master_addr="train-0.train",
                               port=29500, python="python3")
    assert argv[:7] == ["python3", "-m", "torch.distributed.run", "--nproc-per-node=8",
                        "--nnodes=2", "--node-rank=1", "--master-addr=train-0.train"]
    pairs = dict(zip(argv[10::2], argv[11::2]))
    assert pairs["--experts"] == "128" and pairs["--topk"] == "8" and pairs["--hidden"] == "2048"
    assert pairs["--backend"] == "nccl" and pairs["--dispatcher"] == "alltoall"
