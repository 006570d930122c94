"""Stage 04: the MoE model is served and answers.

The stage's place has the model and serves it (lib.places). On the local place: the seeded
random-weight Qwen3-MoE (lib.engines.models, built through the door) behind ``transformers
serve`` (lib.engines.transformers), or with engine 'vllm' (the default where vllm imports and 2+
GPUs are present) at the default model's per-layer shape behind vLLM with DP = the GPUs and
expert parallelism on (lib.engines.vllm_server), whose log gates the all-to-all backend, the EP
split, eager mode and every rank's NCCL init. A place that cannot serve says why in one SKIP
per gate. Gates: the model built from its seed; the
server ready within server_timeout_s; /v1/models lists the model; its config.json is a Mixture of
Experts; a chat request answers 200 with content and usage; the server stopped with nothing left.

Artifacts in the stage folder: server.log (the server's whole output), model.json (the build's
answer), model_config.json (the model's config.json as served), models_response.json and
chat_response.json (the answers as received).
"""
from __future__ import annotations

from typing import Any

from lib import places
from lib.core.evidence import skip
from lib.core.stage import Stage
from lib.engines import catalog, server as serve
from lib.places import ServeSpec, Unsupported
from lib.stages.refusal import refusals_fail, shows_refusal

CLUSTER_GATES = ["server ready", "/v1/models lists the model",
                 "model config is a Mixture of Experts",
                 "chat request answers with content and usage"]
READY_GATES = CLUSTER_GATES[1:]


@refusals_fail
def run(stage: Stage) -> dict[str, Any]:
    place = places.for_stage(stage)
    engine = serve.resolve_engine(stage["engine"])
    try:
        model, built = place.model(engine, announce=True)
    except Unsupported as why:
        stage.add(*[skip(name, str(why)) for name in CLUSTER_GATES])
        return {"skipped": str(why)}
    stage.add(built)
    if model is None:
        stage.add(*serve.skip_gates(CLUSTER_GATES, "the model could not be built (see the gate "
                                                   "'model built from its seed')"))
        return {"skipped": "the model could not be built"}
    stage.write_json("model.json", {k: (stage.door.norm(v) if k == "model_dir" else v)
                                    for k, v in model.items()})
    data: dict[str, Any] = {"engine": engine,
                            "model": {k: v for k, v in model.items() if k != "model_dir"},
                            "model_dir": stage.door.norm(model["model_dir"])}
    if catalog.engine(engine).expert_parallel:
        return run_expert_parallel(stage, place, model, data, engine)
    try:
        with place.serve(ServeSpec(engine, model, timeout_s=stage["server_timeout_s"],
                                   nodes=stage["nodes"])) as server:
            data.update(port=server.port, ready=server.ready, ready_s=server.ready_s,
                        log=stage.rel(server.log_path))
            if server.ready:
                answers(stage, place, server, model, data)
                data.update(rss_bytes=place.server_rss(server))
            else:
                stage.add(*serve.skip_gates(READY_GATES, "the server is not ready (see the "
                                                         "gate 'server ready')"))
    except Unsupported as why:  # a plan: the serve rendered and checked, not started
        stage.add(*[skip(name, str(why)) for name in CLUSTER_GATES])
        data["skipped"] = str(why)
    return data


def answers(stage: Stage, place, server, model: dict[str, Any], data: dict[str, Any]) -> None:
    """What a ready server must answer, whatever the engine: /v1/models lists the model, its
    config is an MoE, a chat request answers with content and usage."""
    listed, body = serve.models_gate(stage, server)
    stage.add(listed)
    if body is not None:
        stage.write_json("models_response.json", body)
    config, saved = place.read_model_config(server, model)
    stage.add(serve.moe_gate(config, saved, data["model_dir"]))
    chat, answer = serve.chat_gate(stage, server)
    stage.add(chat)
    stage.write_json("chat_response.json", answer["body"])
    data.update(config=config, chat=answer)


def run_expert_parallel(stage: Stage, place, model: dict[str, Any], data: dict[str, Any],
                        engine: str) -> dict[str, Any]:
    """An expert-parallel engine (vLLM, SGLang) on the place's GPUs: DP = EP over every GPU of
    every node, the backend asked for (argv and env from the engine, lib.engines.base)."""
    backend = stage["all2all_backend"]
    title = catalog.engine(engine).title
    if backend == "deepep_v2":  # set explicitly: its default moved across releases
        data["deepep_v2_mode"] = stage["deepep_v2_mode"]
    try:
        gpus = place.gpus()
        data.update(gpus=gpus * stage["nodes"], backend=backend)  # DP = EP over every node
        with place.serve(ServeSpec(engine, model, backend=backend, num_comms=1,
                                   timeout_s=stage["server_timeout_s"], gpus=gpus,
                                   nodes=stage["nodes"])) as server:
            data.update(port=server.port, ready=server.ready, ready_s=server.ready_s,
                        log=stage.rel(server.log_path), startup_s=server.startup_s,
                        argv=[stage.door.norm(a) for a in server.argv], env=server.env,
                        backend_gates=[g["gate"] + ": " + g["status"]
                                       for g in server.backend_gates or []])
            if server.ready:
                answers(stage, place, server, model, data)
            else:
                stage.add(*serve.skip_gates(READY_GATES, f"{title} is not ready (see the gate "
                                                         "'server ready')"))
    except Unsupported as why:  # a plan: the serve rendered and checked, not started
        stage.add(*[skip(name, str(why)) for name in CLUSTER_GATES])
        data["skipped"] = str(why)
        return data
    stage.write_json(f"{engine}_serve.json", {k: data.get(k) for k in (
        "gpus", "backend", "deepep_v2_mode", "argv", "env", "ready_s", "startup_s",
        "backend_gates")})
    return data


def mode_given(data: dict[str, Any]) -> str:
    """The DeepEP-V2 mode the serve asked, with how each rank was given it (the engine's
    variable or flag, from the serve's recorded env and argv)."""
    given = catalog.deepep_v2_mode_given(data.get("argv") or [], data.get("env") or {})
    return f"{data['deepep_v2_mode']}" + (f" ({given})" if given else "")


def facts(data: dict[str, Any]) -> "pd.DataFrame":
    import pandas as pd

    model, chat, config = data.get("model") or {}, data.get("chat") or {}, data.get("config") or {}
    usage = chat.get("usage") or {}
    rows = [
        ("engine", data.get("engine")),
        ("model", data.get("model_dir")),
        ("config hash", model.get("config_hash")),
        ("parameters", model.get("parameters")),
        ("experts (top-k)", f"{config.get('num_experts', config.get('num_local_experts'))} "
                            f"(top-{config.get('num_experts_per_tok')})" if config else None),
        ("layers x hidden", f"{config.get('num_hidden_layers')} x {config.get('hidden_size')}"
         if config else None),
        ("server ready after (s)", data.get("ready_s")),
        *([("GPUs (DP = EP size)", data.get("gpus")),
           ("all-to-all backend asked", data.get("backend")),
           *([("DeepEP-V2 mode given to every rank", mode_given(data))]
             if data.get("deepep_v2_mode") else []),
           (("vLLM log: first line to last API server up (s)" if data.get("engine") == "vllm"
             else "log: first line to the last start-up line (s)"), data.get("startup_s")),
           ("backend gates", "; ".join(data.get("backend_gates") or []))]
          if data.get("engine") in catalog.ENGINES
          and catalog.engine(data["engine"]).expert_parallel else []),
        ("chat: HTTP status", chat.get("status")),
        ("chat: prompt / completion tokens",
         f"{usage.get('prompt_tokens')} / {usage.get('completion_tokens')}" if usage else None),
        ("chat: latency (s)", chat.get("duration_s")),
        ("server resident memory (MiB)",
         round(data["rss_bytes"] / 2 ** 20, 1) if data.get("rss_bytes") else None),
        ("server log", data.get("log")),
    ]
    return pd.DataFrame(rows, columns=["fact", "value"]).astype({"value": str})


@shows_refusal
def show(stage: Stage, data: dict[str, Any]) -> None:
    from IPython.display import display

    if data.get("skipped"):
        print(f"not measured: {data['skipped']}")
        return
    display(facts(data))
    chat = data.get("chat") or {}
    if chat:
        print(f"chat reply ({len(chat.get('content') or '')} chars, random weights: the text is "
              f"not meant to read well):\n{(chat.get('content') or '')[:200]!r}")

