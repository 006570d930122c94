"""Every parameter of every stage: type, allowed values, default per context.

A notebook's `parameters` cell holds literal defaults (None meaning "the context's default");
`resolve` turns them into validated values. Bad input stops here, naming the parameter and its
allowed values, before any effect and before anything is written into a run.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from lib.agreement import PROMPTS as ANSWER_PROMPTS

CONTEXTS = ("local", "plan", "kube")
ENGINES = ("transformers", "vllm")
# vLLM 0.24.0's --all2all-backend values that serve as asked (lib.vllm_args.BACKENDS, which
# proves the two equal; 'naive' and 'pplx' are removed there and refused).
ALL2ALL_BACKENDS = (
    "deepep_high_throughput", "deepep_low_latency", "deepep_v2", "mori_high_throughput",
    "mori_low_latency", "nixl_ep", "allgather_reducescatter", "flashinfer_all2allv",
    "flashinfer_nvlink_two_sided", "flashinfer_nvlink_one_sided",
)
STAGES = (
    "00_cluster", "01_public_roots", "02_image", "03_kernel_test", "04_serve", "05_sweep",
    "06_multicomm",
)
RUN_ID_RULE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class ParameterError(ValueError):
    """A parameter's value is not allowed; the message names it and the allowed values."""

    def __init__(self, name: str, value: Any, allowed: str):
        self.name, self.value, self.allowed = name, value, allowed
        super().__init__(f"parameter {name!r} = {value!r} is not allowed; allowed: {allowed}")


NO_LEGACY = object()  # a parameter whose default is what runs recorded before it did


@dataclass(frozen=True)
class Param:
    name: str
    allowed: str  # said to a person when the value is refused
    check: Callable[[Any], Any]  # returns the normalised value or raises ValueError
    defaults: dict[str, Any]  # per context; key "*" for every context
    help: str
    # What a run recorded before the parameter existed did, when that is not the default:
    # its replay takes this value (lib.stage._open_replay), so a better default for new runs
    # never makes an older recording disagree with itself.
    legacy: Any = NO_LEGACY

    def default(self, context: str, engine: str = "") -> Any:
        """The default for `context`; a key "<context>:<engine>" wins for that engine (the vLLM
        serve on two GPUs sweeps the cluster's concurrency levels, not the CPU's)."""
        if engine and f"{context}:{engine}" in self.defaults:
            return self.defaults[f"{context}:{engine}"]
        return self.defaults.get(context, self.defaults.get("*"))


def _int_at_least(low: int):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, (int, str)) or not str(v).strip().lstrip("-").isdigit():
            raise ValueError
        n = int(v)
        if n < low:
            raise ValueError
        return n
    return check


def _int_range(low: int, high: int):
    at_least = _int_at_least(low)

    def check(v):
        n = at_least(v)
        if n > high:
            raise ValueError
        return n
    return check


def _float_above(low: float):
    def check(v):
        f = float(v)
        if not f > low:
            raise ValueError
        return f
    return check


def _one_of(options):
    def check(v):
        if v not in options:
            raise ValueError
        return v
    return check


def _run_id(v):
    if not isinstance(v, str) or (v and (not RUN_ID_RULE.match(v) or ".." in v)):
        raise ValueError
    return v


def _text(v):
    if not isinstance(v, str):
        raise ValueError
    return v


def _results_dir(v):
    if not isinstance(v, str) or not v or "\x00" in v:
        raise ValueError
    return v


def _bool(v):
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError


def _int_list(v):
    """'1,2,4' or [1, 2, 4] -> [1, 2, 4]: positive, unique, ascending."""
    items = v if isinstance(v, (list, tuple)) else str(v).replace(" ", "").split(",")
    values = [_int_at_least(1)(x) for x in items if str(x) != ""]
    if not values or len(set(values)) != len(values):
        raise ValueError
    return sorted(values)


def _backend_list(v):
    """'' -> []; 'a,b' or [a, b] -> [a, b]: two or more distinct vLLM backends, order kept."""
    items = v if isinstance(v, (list, tuple)) else [x for x in str(v).replace(" ", "").split(",")
                                                     if x]
    if not items:
        return []
    if len(items) < 2 or len(set(items)) != len(items) or any(
            x not in ALL2ALL_BACKENDS for x in items):
        raise ValueError
    return list(items)


_PARAMS = [
    Param("context", "one of " + ", ".join(CONTEXTS), _one_of(CONTEXTS), {"*": "local"},
          "where the stage runs"),
    Param("run_id", "'' (a new run) or letters, digits, '.', '_', '-' (1-64 chars, starting "
          "with a letter or digit, no '..')", _run_id, {"*": ""}, "the run to record into"),
    Param("results_dir", "a directory path", _results_dir, {"*": "results"},
          "where run directories live (relative to the repository)"),
    Param("seed", "an integer >= 0", _int_at_least(0), {"*": 0}, "seed of every random draw"),
    Param("nodes", "an integer >= 1 (1 on the local context)", _int_at_least(1),
          {"local": 1, "plan": 2, "kube": 2}, "nodes in the run"),
    Param("gpus_per_node", "an integer >= 0", _int_at_least(0), {"plan": 8, "kube": 8},
          "GPUs per node (local: detected)"),
    Param("kube_context", "a kubectl context name", _text, {"*": ""}, "kubectl context"),
    Param("namespace", "a Kubernetes namespace", _text, {"*": "deepep-repro"}, "namespace"),
    # 03 kernel test (DeepEP test_ep's meaning)
    Param("ranks", "an integer >= 2", _int_at_least(2), {"local": 2}, "processes (local)"),
    Param("num_tokens", "an integer >= 1", _int_at_least(1), {"*": 128}, "tokens per rank"),
    Param("hidden", "an integer >= 1", _int_at_least(1), {"plan": 7168, "kube": 7168},
          "hidden size (local: 7168 on GPUs, 256 on CPU)"),
    Param("num_topk", "an integer >= 1, <= num_experts", _int_at_least(1), {"*": 8}, "top-k"),
    Param("num_experts", "an integer >= 1, divisible by the ranks", _int_at_least(1),
          {"*": 256}, "experts"),
    Param("num_comms", "an integer >= 1", _int_at_least(1), {"*": 1},
          "communicators the all-to-all is striped over (EP_NUM_COMMS)"),
    Param("iters", "an integer >= 1", _int_at_least(1), {"local": 30, "*": 50}, "timed iterations"),
    Param("warmup", "an integer >= 0", _int_at_least(0), {"*": 5}, "untimed iterations"),
    # DeepEP itself on a GPU machine (local): 03 runs its test_ep beside the torch benchmark
    Param("deepep_dir", "'' (none) or the path of a DeepEP checkout built in place "
          "(docker/build_deepep.sh)", _text, {"*": ""},
          "DeepEP built on this machine (local, 2+ GPUs): 03 runs its tests/elastic/test_ep.py, "
          "vLLM's deepep_* backends import it"),
    Param("nccl_site", "'' (none) or a site-packages folder holding nvidia-nccl-cu13 2.30.4",
          _text, {"*": ""}, "the NCCL DeepEP was built for, preloaded intranode (lib.transport)"),
    Param("test_ep_tokens", "a list of integers >= 1, e.g. '128,512,4096'", _int_list,
          {"*": [128, 512, 4096]}, "tokens per rank of each test_ep run (and the torch "
                                   "benchmark beside it)"),
    # 04 serve
    Param("engine", "one of " + ", ".join(ENGINES) + " ('' picks by hardware)",
          lambda v: "" if v == "" else _one_of(ENGINES)(v), {"*": ""}, "serving engine"),
    Param("server_timeout_s", "a number of seconds > 0", _float_above(0),
          {"local": 180.0, "local:vllm": 900.0, "*": 1800.0},
          "how long to wait for the server to be ready"),
    Param("model_layers", "an integer >= 1", _int_at_least(1), {"*": 2},
          "decoder layers of the seeded model (both engines; the per-layer shape is the engine's)"),
    Param("all2all_backend", "one of " + ", ".join(ALL2ALL_BACKENDS), _one_of(ALL2ALL_BACKENDS),
          {"local": "allgather_reducescatter", "*": "deepep_v2"},
          "vLLM's --all2all-backend (engine vllm; deepep_* needs DeepEP built here)"),
    # 05 sweep
    Param("concurrency", "a list of integers >= 1, e.g. '1,2,4'", _int_list,
          {"local": [1, 2, 4], "local:vllm": [4, 8, 32], "plan": [4, 8, 32], "kube": [4, 8, 32]},
          "concurrency levels"),
    Param("request_count", "an integer >= 1", _int_at_least(1),
          {"local": 16, "local:vllm": 48, "*": 128},
          "measured requests per cell"),
    Param("requests_per_slot", "an integer >= 0", _int_at_least(0), {"*": 5},
          "each cell measures at least this many requests per concurrency slot: "
          "max(request_count, requests_per_slot x concurrency), the public review's 5x "
          "requests per level (48 requests at concurrency 32 are one and a half waves, mostly "
          "ramp and tail); 0: request_count at every level", legacy=0),
    Param("warmup_requests", "an integer >= 0", _int_at_least(0),
          {"local": 2, "local:vllm": 8, "*": 16},
          "unmeasured warmup requests per cell"),
    Param("warmup_full_batch", "true or false", _bool, {"*": True},
          "each cell's warmup is at least its concurrency, so the first full batch (and the "
          "kernels compiled for its shapes) is not measured; false: warmup_requests as given",
          legacy=False),
    Param("repeats", "an integer >= 1", _int_at_least(1), {"*": 3}, "repeats per cell"),
    Param("input_tokens", "an integer >= 1", _int_at_least(1),
          {"local": 64, "local:vllm": 120, "*": 120},
          "synthetic input tokens (mean)"),
    Param("output_tokens", "an integer >= 1", _int_at_least(1),
          {"local": 16, "local:vllm": 128, "*": 128},
          "output tokens per request"),
    Param("ab_backends", "'' (none) or two or more of " + ", ".join(ALL2ALL_BACKENDS)
          + ", comma-separated, the first the baseline", _backend_list, {"*": []},
          "05 with engine vllm: these backends side by side, arms interleaved, both traffic "
          "shapes (deepep_v2 vs allgather_reducescatter)"),
    Param("prefill_input_tokens", "an integer >= 1", _int_at_least(1), {"*": 1536},
          "the prefill-heavy traffic shape of the backend A/B: input tokens"),
    Param("prefill_output_tokens", "an integer >= 1", _int_at_least(1), {"*": 16},
          "the prefill-heavy traffic shape of the backend A/B: output tokens"),
    Param("answer_prompts", f"an integer from 0 to {len(ANSWER_PROMPTS)}",
          _int_range(0, len(ANSWER_PROMPTS)), {"*": len(ANSWER_PROMPTS)},
          "engine vllm, arms side by side (05's backend A/B, 06): each arm is asked this many "
          "fixed prompts (greedy, top logprobs) before its cells, and each compared arm must "
          "answer as the baseline does (lib.agreement); 0: not asked", legacy=0),
    # 06 multicomm
    Param("arm_a_comms", "an integer >= 1", _int_at_least(1), {"*": 1}, "arm A communicators"),
    Param("arm_b_comms", "an integer >= 1", _int_at_least(1), {"*": 8}, "arm B communicators"),
    Param("ab_repeats", "an integer >= 2", _int_at_least(2),
          {"local": 5, "local:vllm": 3, "*": 5},
          "repeats per arm, interleaved"),
]
PARAMS = {p.name: p for p in _PARAMS}

COMMON = ("context", "run_id", "results_dir", "seed", "nodes", "gpus_per_node", "kube_context",
          "namespace")
SERVE = ("engine", "server_timeout_s", "model_layers", "all2all_backend", "nccl_site",
         "deepep_dir")
TRAFFIC = ("concurrency", "request_count", "requests_per_slot", "warmup_requests",
           "warmup_full_batch", "input_tokens", "output_tokens")
KERNEL = ("ranks", "num_tokens", "hidden", "num_topk", "num_experts", "num_comms", "iters", "warmup")
DEEPEP = ("deepep_dir", "nccl_site", "test_ep_tokens")
STAGE_PARAMS: dict[str, tuple[str, ...]] = {
    "00_cluster": COMMON,
    "01_public_roots": COMMON,
    "02_image": COMMON,
    "03_kernel_test": COMMON + KERNEL + DEEPEP,
    "04_serve": COMMON + SERVE,
    "05_sweep": COMMON + SERVE + TRAFFIC + ("repeats", "ab_backends", "prefill_input_tokens",
                                            "prefill_output_tokens", "answer_prompts"),
    "06_multicomm": COMMON + KERNEL + ("arm_a_comms", "arm_b_comms", "ab_repeats") + SERVE
                    + TRAFFIC + ("answer_prompts",),
}


def resolve(stage: str, given: dict[str, Any]) -> dict[str, Any]:
    """Validated parameters of `stage`: given values win, None takes the context's default."""
    if stage not in STAGE_PARAMS:
        raise ParameterError("stage", stage, "one of " + ", ".join(STAGES))
    names = STAGE_PARAMS[stage]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ParameterError(unknown[0], given[unknown[0]], f"the parameters of {stage}: "
                             + ", ".join(names))
    context = given.get("context")
    context = PARAMS["context"].default("") if context is None else context
    _checked(PARAMS["context"], context)
    engine = given.get("engine") or ""
    resolved: dict[str, Any] = {}
    for name in names:
        value = given.get(name)
        if value is None:
            value = PARAMS[name].default(context, engine)
        resolved[name] = None if value is None else _checked(PARAMS[name], value)
    _check_together(resolved)
    return resolved


def check_run_request(context: str, run_id: str | None, stages: list[str] | None,
                      given: dict[str, Any]) -> None:
    """What `python -m lib.runner run` was asked, checked before the run directory exists.

    Each stage checks its own parameters again, together, in its first cell; this catches
    what would otherwise leave an empty or misplaced run behind: a run id that is a path, an
    unknown context or stage, a parameter no selected stage takes, a value its rule refuses."""
    _checked(PARAMS["context"], context)
    if run_id is not None:
        _checked(PARAMS["run_id"], run_id)
        if not run_id:
            raise ParameterError("run_id", run_id, PARAMS["run_id"].allowed.replace(
                "'' (a new run) or ", "")) from None
    for stage in stages or STAGES:
        if stage not in STAGE_PARAMS:
            raise ParameterError("stages", stage, "a comma-separated subset of "
                                 + ", ".join(STAGES))
    names = sorted({n for s in stages or STAGES for n in STAGE_PARAMS[s]} - {"context", "run_id"})
    for name, value in given.items():
        if name not in names:
            raise ParameterError(name, value, "a parameter of the stages asked ("
                                 + ", ".join(stages or STAGES) + "): " + ", ".join(names))
        _checked(PARAMS[name], value)


def _checked(param: Param, value: Any) -> Any:
    try:
        return param.check(value)
    except (ValueError, TypeError):
        raise ParameterError(param.name, value, param.allowed) from None


def _check_together(p: dict[str, Any]) -> None:
    """Rules across parameters: said in terms of the parameter a person would change."""
    if p.get("context") == "local" and p.get("nodes") not in (None, 1):
        raise ParameterError("nodes", p["nodes"], "1 on the local context (more needs kube)")
    experts, topk = p.get("num_experts"), p.get("num_topk")
    if experts is not None and topk is not None and topk > experts:
        raise ParameterError("num_topk", topk, f"an integer from 1 to num_experts ({experts})")
    ranks = p.get("ranks") if p.get("context") == "local" else _world(p)
    if experts is not None and ranks and experts % ranks:
        raise ParameterError("num_experts", experts,
                             f"a multiple of the ranks ({ranks}) so every rank holds whole experts")
    if p.get("deepep_dir") and not p.get("nccl_site"):
        raise ParameterError("nccl_site", p.get("nccl_site"),
                             "a site-packages folder holding nvidia-nccl-cu13 2.30.4 whenever "
                             "deepep_dir is given: DeepEP built for it segfaults on torch's "
                             "own NCCL unless it is preloaded")
    # A deepep_* backend served by vLLM on local needs DeepEP built here and the NCCL it was built
    # for. engine '' picks vLLM on a GPU machine at run time: only 'transformers' rules vLLM out.
    deepep_needs = (("nccl_site", "a site-packages folder holding nvidia-nccl-cu13 2.30.4 with "
                                  "the backend {backend!r} (DeepEP on PYTHONPATH, built for that "
                                  "NCCL)"),
                    ("deepep_dir", "the path of DeepEP built on this machine "
                                   "(docker/build_deepep.sh) with the backend {backend!r}: vLLM "
                                   "imports deep_ep from it"))
    for backend in [p.get("all2all_backend") or "", *(p.get("ab_backends") or [])]:
        if (p.get("context") == "local" and p.get("engine") != "transformers"
                and backend.startswith("deepep")):
            for name, allowed in deepep_needs:
                if not p.get(name):
                    raise ParameterError(name, p.get(name), allowed.format(backend=backend))
    if p.get("ab_backends") and p.get("engine") == "transformers":
        raise ParameterError("ab_backends", p["ab_backends"],
                             "'' with engine 'transformers' (it has no all-to-all backend)")
    a, b = p.get("arm_a_comms"), p.get("arm_b_comms")
    if a is not None and a == b:
        raise ParameterError("arm_b_comms", b, f"a value different from arm_a_comms ({a})")


def _world(p: dict[str, Any]) -> int | None:
    if p.get("nodes") and p.get("gpus_per_node"):
        return p["nodes"] * p["gpus_per_node"]
    return None
