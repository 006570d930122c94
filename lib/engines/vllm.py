"""vLLM as an engine (lib.engines.base): its argv and env from the one builder
(lib.engines.vllm_args.vllm_serve), its log gates from lib.engines.vllm_logs.

What its logs prove on a cluster: the all-to-all manager vLLM built, its prepare/finalize and
the EP split (vLLM logs those from rank 0 only: the leader's log), eager or graphs, every API
server up, and over every process's log: no legacy DeepEP buffer, NCCL's init on every DP rank,
NCCL's EFA provider on every DP rank.
"""
from __future__ import annotations

from typing import Mapping

from lib.engines import vllm_logs, vllm_server
from lib.engines.vllm_server import LOG_NAME, STARTUP_LINE
from lib.engines.base import Engine, EngineSpec
from lib.engines.transport import (CPU_TIMEOUT_VAR, DEFAULT_PLUGIN_PATH, ELASTIC_TIMEOUT_S,
                                   GPU_TIMEOUT_VAR)
from lib.engines.vllm_args import BACKENDS, CLI_MODULE, vllm_serve
from lib.engines.deepep import DEFAULT_MODE

# vLLM 0.24.0's routes: its log lists "Route: /health, Methods: GET" and /metrics
READY_PATH = "/health"
METRICS_PATH = "/metrics"


class VllmEngine(Engine):
    name = "vllm"
    title = "vLLM"
    ready_path = READY_PATH
    metrics_path = METRICS_PATH
    proves_backend = True
    expert_parallel = True
    backends = BACKENDS
    pin = "vllm"

    def command(self, spec: EngineSpec) -> tuple[list[str], dict[str, str]]:
        """One process of the serve (lib.engines.vllm_args renders it), with weights and
        tokenizer both at `revision` when one is pinned."""
        argv, env = vllm_serve(
            spec.role, model=spec.model, served_model_name=spec.served_model_name,
            backend=spec.backend, dp_size=spec.dp_size, dp_size_local=spec.gpus_per_node,
            dp_start_rank=spec.start_rank, dp_address=spec.rendezvous,
            dp_rpc_port=spec.rpc_port, port=spec.port, enforce_eager=spec.enforce_eager,
            max_model_len=spec.max_model_len,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            ep_num_comms=spec.ep_num_comms, transport=spec.transport, nccl_site=spec.nccl_site,
            extra_env=dict(spec.extra_env) or None, python=spec.python,
            plugin_path=spec.plugin_path or DEFAULT_PLUGIN_PATH,
            expert_parallel=spec.expert_parallel,
            deepep_v2_mode=spec.deepep_v2_mode or DEFAULT_MODE)
        if spec.revision:
            # vllm_serve takes no revision: --revision and --tokenizer-revision, both pinned
            argv += ["--revision", spec.revision, "--tokenizer-revision", spec.revision]
        return argv, env

    def process_words(self, spec: EngineSpec) -> list[str]:
        return [CLI_MODULE, "serve"] if spec.python else ["vllm", "serve"]

    def log_gates(self, leader: str, logs: Mapping[str, str], spec: EngineSpec, *,
                  log_name: str, evidence: list[str], api_servers: int) -> list[dict]:
        # API servers: the leader's, one per local DP rank (vLLM's api_server_count default)
        gates = vllm_logs.assert_backend(leader, spec.backend, dp_size=spec.dp_size,
                                         num_experts=spec.num_experts, log_name=log_name,
                                         api_servers=api_servers)
        gates.append(vllm_logs.compile_mode_gate(leader, spec.enforce_eager, log_name=log_name))
        every = "\n".join(logs.values())
        sources = ", ".join(evidence)
        # the no-legacy gate over every process's log, not the leader's alone
        gates = [vllm_logs.no_legacy_gate(every, spec.backend, log_name=sources)
                 if g["gate"] == "vllm_no_fallback_no_legacy_buffer" else g for g in gates]
        gates.append(vllm_logs.per_rank_nccl(every, spec.dp_size, log_name=sources))
        gates.append(vllm_logs.efa_provider_per_rank(every, spec.dp_size, log_name=sources))
        # GIN type 5: every rank read its two settings (none on the other contracts)
        gates += vllm_logs.transport_gates(every, spec.dp_size, spec.transport, log_name=sources)
        return gates

    def settings_gates(self, logs: Mapping[str, str], spec: EngineSpec, *,
                       evidence: list[str]) -> list[dict]:
        if spec.backend != "deepep_v2":
            return []
        # ElasticBuffer's timeouts and DeepEP-V2 mode, patch 0002's line on every rank (the
        # image applies it)
        return vllm_logs.patch_0002_gates(
            "\n".join(logs.values()), spec.dp_size, mode=spec.deepep_v2_mode or DEFAULT_MODE,
            site_patches=vllm_logs.IMAGE_SITE_PATCHES,
            gpu_s=int(spec.extra_env.get(GPU_TIMEOUT_VAR, ELASTIC_TIMEOUT_S)),
            cpu_s=int(spec.extra_env.get(CPU_TIMEOUT_VAR, ELASTIC_TIMEOUT_S)),
            log_name=", ".join(evidence))

    def first_fatal(self, text: str) -> str | None:
        return vllm_logs.first_fatal_line(text)

    log_name = LOG_NAME

    def wait_ready(self, stage, server, timeout_s: float):
        return vllm_server.wait_ready(stage, server, timeout_s)

    def settled(self, leader_log: str, api_servers: int) -> bool:
        # one "Application startup complete." per API server (one per local DP rank)
        return leader_log.count(STARTUP_LINE) >= api_servers

    def startup_seconds(self, leader_log: str) -> float | None:
        return vllm_logs.startup_seconds(leader_log)

    def crashed_step(self, text: str) -> dict | None:
        return vllm_logs.crashed_step(text)
