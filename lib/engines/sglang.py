"""SGLang as an engine (lib.engines.base): its argv, env and log gates.

Every flag, default and log line below was read from SGLang 0.5.19's released wheel
(sglang-0.5.19-cp311-cp311-manylinux_2_34_x86_64.whl from PyPI, read here 2026-12-03; paths are
inside the wheel), the first release with SGLang's native DeepEP-V2 backend (#29525, relanded as
#35634 on 2026-08-20). None of it has run here: SGLang needs a GPU build and ~1 GB of wheels
beyond the image, so this engine is rendered, validated and run against composed logs only.

The serve (one process per node, as vLLM's): `sglang serve` (console script
`sglang = sglang.cli.main:main`, entry_points.txt; `python -m sglang.launch_server` still works
and warns, sglang/launch_server.py:63-69) with

- DP attention over every GPU and TP = EP = DP (the guide's DP16/EP16 layout): `--tp-size`,
  `--dp-size`, `--enable-dp-attention`, `--ep-size` (server_args.py:937-976, 1075, 2357);
  `--tp`/`--dp` are argparse abbreviations, not aliases, so the full names are used;
- `--moe-a2a-backend deepep_v2` (server_args.py:2366-2395) with `--deepep-v2-mode hybrid` across
  nodes, `direct` on one (server_args.py:2406), and `--moe-runner-backend deep_gemm`, the only
  runner deepep_v2 takes (arg_groups/moe_hook.py:194-208); the guide's allgather_reducescatter
  is SGLang's `none` (expert parallelism without an all-to-all);
- `--nnodes`, `--node-rank`, `--dist-init-addr host:port` (server_args.py:922-936); only node
  rank 0 serves the API; every other node answers /health from a stub server on the same port
  (engine.py:1147-1166, utils/common.py:3301-3361), which is its readiness here too;
- `--host 0.0.0.0` (SGLang's default is 127.0.0.1, server_args.py:1223), the guide's port
  (SGLang's default is 30000, server_args.py:1224), `/metrics` only with `--enable-metrics`
  (server_args.py:1501);
- a per-rank dispatch budget: SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK defaults to 128
  (environ.py:1107) and start-up refuses a chunked-prefill size above it (moe_hook.py:379-423;
  with DP attention the size is divided by the DP size first, parallel_hook.py:197-207): the
  guide sets the budget and the chunked-prefill size together (DISPATCH_TOKENS_PER_RANK).

What SGLang checks itself and the guide leaves to it (moe_hook.py:182-242, 426-457;
fused_moe_triton/layer.py:240-265): a DeepseekV3/V4 or Qwen3MoeForCausalLM checkpoint with
128x128 blockwise FP8 experts and dynamic activation scaling, no two-batch or single-batch
overlap, no deterministic inference; EP size forced to the TP size.
"""
from __future__ import annotations

import re
from typing import Mapping

from lib.engines import nccl_logs
from lib.engines.base import Engine, EngineSpec
from lib.engines.nccl_logs import lines_of, quote
from lib.engines.transport import DEFAULT_PLUGIN_PATH, transport_env
from lib.core.evidence import gate

READ_FROM = "SGLang 0.5.19's wheel (PyPI, read 2026-12-03)"
CONSOLE_SCRIPT = "sglang"
LAUNCH_MODULE = "sglang.launch_server"
DEFAULT_PORT = 30000  # SGLang's own; the guide serves on the place's port
READY_PATH = "/health"  # 200 once a 1-token generation answers (http_server.py:662-737)
METRICS_PATH = "/metrics"  # with --enable-metrics
# the guide's all-to-all backend names (vLLM's, the guide's vocabulary) -> SGLang's
A2A_BACKENDS = {"deepep_v2": "deepep_v2", "allgather_reducescatter": "none"}
# Per-rank tokens a dispatch may carry: the public reproduction's SGLang 0.5.11 seam ran 1024
# (SGLang's default 128 asserted in DeepEP's buffer.hpp there); here it bounds the
# chunked-prefill size, DP ranks x this (moe_hook.py:379-423).
DISPATCH_TOKENS_ENV = "SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK"
DISPATCH_TOKENS_PER_RANK = 1024

# ---- what its logs print (format: "[%Y-%m-%d %H:%M:%S TP3 EP3] message", utils/common.py:
# 2353-2373, the rank part from managers/scheduler.py:5494-5514; the launcher's own lines carry
# no rank) -----------------------------------------------------------------------------------
_RANK_RE = re.compile(r"^\[[0-9-]+ [0-9:.]+((?: [A-Z_]+\d+)*)\] ")
_EP_OF_RE = re.compile(r"\bEP(\d+)\b")
# token_dispatcher/deepep_v2.py:198-209, logger.info on every rank, on its first dispatch
_BUFFER_RE = re.compile(r"Initialized DeepEP v2 ElasticBuffer: world_size=(\d+) hidden_size=(\d+) "
                        r"num_topk=(\d+) max_dispatch_tokens_per_rank=(\d+) "
                        r"use_fp8_dispatch=(\w+) allow_hybrid_mode=(\w+)")
# moe_hook.py:232-242, once per node (the launcher's argument resolution)
MODE_FLAG = "--deepep-v2-mode"  # SGLang 0.5.19's flag for DeepEP v2's mode
_MODE_RE = re.compile(r"DeepEP v2 MoE is using deepep_v2_mode=(\w+)\.")
# engine.py:1098, once per node: the resolved arguments as a Python dict
_ARGS_RE = re.compile(r"server_args=\{.*?'moe_a2a_backend': '(\w+)'")
READY_LINE = "The server is fired up and ready to roll!"  # http_server.py:2412, node rank 0
_FATAL_RE = re.compile(
    r"Scheduler hit an exception"  # managers/scheduler.py:5604
    r"|Received sigquit from a child process"  # entrypoints/engine.py:1729-1731
    r"|scheduler died during initialization"  # entrypoints/engine.py:1783-1790
    r"|Initialization failed\. warmup error"  # entrypoints/http_server.py:2221, 2360
    r"|crashed with exit code"  # utils/watchdog.py:216-220
    r"|watchdog timeout \("  # utils/watchdog.py:153-156
    r"|DeepEP v2 (?:MoE (?:is not validated|cannot|does not|currently supports only|has not)"
    r"|per-rank \w+ (?:budget|CUDA graph) exceeds|dispatch input exceeds|\(ElasticBuffer\) is "
    r"not available)"  # moe_hook.py, deepep_v2.py
    r"|requires 128x128 blockwise FP8 experts"  # fused_moe_triton/layer.py:240-265
    r"|CUDA error: |NCCL error|Assertion .* failed")


def a2a_backend(backend: str) -> str:
    """SGLang's --moe-a2a-backend for the guide's backend name: one of A2A_BACKENDS, what the
    stage's parameter model allows with engine sglang (SglangEngine.backends)."""
    return A2A_BACKENDS[backend]


def node_rank(spec: EngineSpec) -> int:
    """The node's rank: its first DP rank over GPUs per node (the place gives node k
    k x gpus_per_node)."""
    return spec.start_rank // spec.gpus_per_node


def sglang_env(spec: EngineSpec) -> dict[str, str]:
    """The environment of one SGLang process (any node): the transport's contract, NCCL's own
    per-rank lines on (SGLang prints none of its own), and the dispatch budget."""
    env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV",
           "EP_NUM_COMMS": str(spec.ep_num_comms),
           DISPATCH_TOKENS_ENV: str(DISPATCH_TOKENS_PER_RANK)}
    env.update(transport_env(spec.transport, nccl_site=spec.nccl_site,
                             plugin_path=spec.plugin_path or DEFAULT_PLUGIN_PATH))
    env.update({str(k): str(v) for k, v in spec.extra_env.items()})
    return env


def sglang_argv(spec: EngineSpec) -> list[str]:
    """One node's process (role leader, worker or local, as its place renders it: across nodes
    every node is given the leader's address, `rendezvous`)."""
    a2a = a2a_backend(spec.backend)
    rank = node_rank(spec)
    dp = spec.dp_size
    prog = ([spec.python, "-m", LAUNCH_MODULE] if spec.python
            else [spec.console_script or CONSOLE_SCRIPT, "serve"])
    argv = prog + ["--model-path", spec.model]
    if spec.revision:
        argv += ["--revision", spec.revision]
    argv += ["--tp-size", str(dp), "--dp-size", str(dp), "--enable-dp-attention",
             "--ep-size", str(dp), "--moe-a2a-backend", a2a]
    if a2a == "deepep_v2":
        argv += [MODE_FLAG, mode_asked(spec),
                 "--moe-runner-backend", "deep_gemm"]
    argv += ["--chunked-prefill-size", str(DISPATCH_TOKENS_PER_RANK * dp)]
    if spec.nodes > 1:
        argv += ["--nnodes", str(spec.nodes), "--node-rank", str(rank),
                 "--dist-init-addr", f"{spec.rendezvous}:{spec.rpc_port or 29500}"]
    argv += ["--host", spec.host or "0.0.0.0", "--port", str(spec.port), "--enable-metrics"]
    if spec.enforce_eager:
        argv.append("--disable-cuda-graph")
    if spec.served_model_name:
        argv += ["--served-model-name", spec.served_model_name]
    if spec.gpu_memory_utilization is not None:
        argv += ["--mem-fraction-static", str(spec.gpu_memory_utilization)]
    if spec.max_model_len is not None:
        argv += ["--context-length", str(spec.max_model_len)]
    return argv


# ---- the gates its logs earn ----------------------------------------------------------------
def _ranked(line: str) -> int | None:
    m = _RANK_RE.match(line)
    ep = _EP_OF_RE.search(m.group(1)) if m else None
    return int(ep.group(1)) if ep else None


def backend_gate(leader: str, backend: str, *, log_name: str) -> dict:
    """The leader's resolved arguments name the all-to-all backend asked (engine.py:1098)."""
    want = a2a_backend(backend)
    lines = lines_of(leader)
    found = [(i, l, m.group(1)) for i, l in enumerate(lines, 1) for m in [_ARGS_RE.search(l)] if m]
    got = found[0][2] if found else None
    evidence = [quote(log_name, i, l) for i, l, _ in found[:1]]
    reason = (f"server_args names moe_a2a_backend '{got}'" if found else
              "no server_args={...} line in the leader's log (SGLang logs it at start-up)")
    return gate("sglang_moe_a2a_backend", got == want, got, want, reason, evidence).as_dict()


def buffer_gate(every: str, spec: EngineSpec, *, log_name: str) -> dict:
    """deepep_v2: every EP rank 0..DP-1 initialized its ElasticBuffer over the whole world, in
    hybrid mode across nodes (deepep_v2.py:198-209; built on a rank's first dispatch, which
    warm-up or graph capture makes before the API answers). none: no rank built one."""
    lines = lines_of(every)
    built = [(i, l, m) for i, l in enumerate(lines, 1) for m in [_BUFFER_RE.search(l)] if m]
    dp, hybrid = spec.dp_size, spec.nodes > 1
    if a2a_backend(spec.backend) == "none":
        return gate("sglang_no_deepep_buffer", not built, len(built), 0,
                    f"{len(built)} ElasticBuffer line(s) with --moe-a2a-backend none" if built
                    else "no rank built a DeepEP buffer (--moe-a2a-backend none)",
                    [quote(log_name, i, l) for i, l, _ in built[:8]]).as_dict()
    ranks = sorted({r for i, l, _ in built for r in [_ranked(l)] if r is not None})
    wrong = [(i, l) for i, l, m in built
             if int(m.group(1)) != dp or (m.group(6) == "True") != hybrid]
    missing = [r for r in range(dp) if r not in ranks]
    observed = {"ranks": ranks, "missing": missing, "lines": len(built),
                "wrong_world_or_mode": len(wrong)}
    expected = {"ranks": f"0..{dp - 1}", "world_size": dp, "allow_hybrid_mode": hybrid}
    evidence = [quote(log_name, i, l) for i, l in wrong[:4]] + \
               [quote(log_name, i, l) for i, l, _ in built[:16]]
    if wrong:
        reason = (f"{len(wrong)} ElasticBuffer line(s) not over world_size={dp} with "
                  f"allow_hybrid_mode={hybrid}")
    elif missing:
        reason = (f"rank(s) {', '.join(map(str, missing))} of {dp} logged no 'Initialized "
                  "DeepEP v2 ElasticBuffer' line" if built else
                  "no rank logged 'Initialized DeepEP v2 ElasticBuffer' (SGLang builds it on a "
                  "rank's first dispatch)")
    else:
        reason = (f"every rank of {dp} built its ElasticBuffer over world_size={dp}, "
                  f"{'hybrid' if hybrid else 'direct'} mode")
    return gate("sglang_elastic_buffer_per_rank", not wrong and not missing, observed, expected,
                reason, evidence).as_dict()


def mode_asked(spec: EngineSpec) -> str:
    """The DeepEP v2 mode the serve asks for: the stage's `deepep_v2_mode`, else hybrid across
    nodes and direct on one."""
    return spec.deepep_v2_mode or ("hybrid" if spec.nodes > 1 else "direct")


def mode_gate(logs: Mapping[str, str], spec: EngineSpec) -> dict:
    """deepep_v2: every node's launcher resolved the DeepEP v2 mode asked (moe_hook.py:232)."""
    want = mode_asked(spec)
    modes, evidence = {}, []
    for name, text in logs.items():
        found = [(i, l, m.group(1)) for i, l in enumerate(lines_of(text), 1)
                 for m in [_MODE_RE.search(l)] if m]
        modes[name] = found[0][2] if found else None
        evidence += [quote(name, i, l) for i, l, _ in found[:1]]
    bad = sorted(n for n, m in modes.items() if m != want)
    reason = (f"every node's launcher resolved deepep_v2_mode={want}" if not bad else
              f"{', '.join(bad)}: deepep_v2_mode "
              f"{', '.join(str(modes[n]) for n in bad)}, not {want}")
    return gate("sglang_deepep_v2_mode_per_node", not bad, modes, want, reason,
                evidence).as_dict()


def ready_gate(leader: str, *, log_name: str) -> dict:
    found = [(i, l) for i, l in enumerate(lines_of(leader), 1) if READY_LINE in l]
    return gate("sglang_server_fired_up", bool(found), len(found), 1,
                "the leader logged it was fired up and ready" if found else
                f"no '{READY_LINE}' in the leader's log",
                [quote(log_name, i, l) for i, l in found[:1]]).as_dict()


def first_fatal_line(text: str) -> str | None:
    for line in lines_of(text):
        if _FATAL_RE.search(line):
            return line.strip()
    return None


class SglangEngine(Engine):
    name = "sglang"
    title = "SGLang"
    ready_path = READY_PATH
    metrics_path = METRICS_PATH
    proves_backend = True
    expert_parallel = True
    backends = tuple(A2A_BACKENDS)
    level = "rendered and log-gated (never run here)"
    pin = "sglang"

    def command(self, spec: EngineSpec) -> tuple[list[str], dict[str, str]]:
        return sglang_argv(spec), sglang_env(spec)

    def process_words(self, spec: EngineSpec) -> list[str]:
        return [LAUNCH_MODULE] if spec.python else [spec.console_script or CONSOLE_SCRIPT,
                                                    "serve"]

    def log_gates(self, leader: str, logs: Mapping[str, str], spec: EngineSpec, *,
                  log_name: str, evidence: list[str], api_servers: int) -> list[dict]:
        every = "\n".join(logs.values())
        sources = ", ".join(evidence)
        gates = [backend_gate(leader, spec.backend, log_name=log_name)]
        if a2a_backend(spec.backend) == "deepep_v2":
            gates.append(mode_gate(dict(zip(evidence, logs.values())), spec))
        gates.append(buffer_gate(every, spec, log_name=sources))
        gates.append(ready_gate(leader, log_name=log_name))
        gates.append(nccl_logs.per_rank_nccl(every, spec.dp_size, log_name=sources))
        gates.append(nccl_logs.efa_provider_per_rank(every, spec.dp_size, log_name=sources))
        return gates

    def first_fatal(self, text: str) -> str | None:
        return first_fatal_line(text)

    log_name = "sglang.log"

    def settled(self, leader_log: str, api_servers: int) -> bool:
        return READY_LINE in leader_log  # after warm-up: every rank has dispatched once
