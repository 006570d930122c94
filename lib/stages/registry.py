"""The one stage registry and the one parameter table.

Every reader of "which stages exist, what each takes, what each reads" reads this module: the
stage opener (lib.stages.opening), the runner (order and blocking), the notebook writer
(parameters cells, titles), the report and book (stage pages, _toc.yml), the README's stage
table (tests/test_registry.py compares them).

`resolve(stage, given)` turns a notebook's parameters into validated values: given values win,
None takes the context's default; a refused value raises ParameterError naming the parameter and
its allowed values, before any effect.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lib.core.errors import ParameterError
from lib.core.params import (Param, checked, boolean, choice_list, float_above,  # noqa: F401
                             int_at_least, int_list, int_range, matching, one_of, optional,
                             results_dir, run_id, text, DNS1123_LABEL, IMAGE_RULE,
                             KUBE_CONTEXT_RULE, MODEL_ID_RULE, SLURM_NAME_RULE)
from lib.engines.model_facts import routed_experts
from lib.engines.vllm_args import BACKENDS as ALL2ALL_BACKENDS
from lib.measure.agreement import PROMPTS as ANSWER_PROMPTS
from lib.places.instances import DEFAULT_INSTANCE_TYPE, INSTANCE_TYPES
from lib.roots import pins as pins_mod

CONTEXTS = ("local", "plan", "kube", "slurm")
CLUSTER_PLACES = ("kube", "slurm")  # what `plan` can plan for
ENGINES = ("transformers", "vllm")
WORKLOADS = ("statefulset", "leaderworkerset")
_CLUSTER = ("plan", "kube", "slurm")  # contexts that serve a real model on p5en-class nodes
_MODEL_PIN = pins_mod.load()["pins"]["model"]  # the one source of the cluster model and revision


def _cluster(value) -> dict[str, Any]:
    return {c: value for c in _CLUSTER}


@dataclass(frozen=True)
class StageSpec:
    name: str  # NN_name: the notebook's file name and the stage's folder in a run
    module: str  # lib.stages.<module>: run(stage) and show(stage, data)
    title: str
    proves: str  # one line: the README's stage table and the notebook's first cell
    params: tuple[str, ...]
    reads: tuple[str, ...]  # the upstream stages whose evidence it reads (a FAIL there blocks it)
    # when it serves (engine vllm, or a cluster place): what it reads instead
    reads_when_serving: tuple[str, ...] | None = None
    # whether it acts through its place (a plan then records what the place would run); 01
    # verifies pins at their public sources and touches no place
    uses_place: bool = True

    def upstream(self, serving: bool) -> tuple[str, ...]:
        return self.reads_when_serving if serving and self.reads_when_serving is not None \
            else self.reads


# ---- the parameter table -----------------------------------------------------------------------
_PARAMS = [
    Param("context", "one of " + ", ".join(CONTEXTS), one_of(CONTEXTS), {"*": "local"},
          "where the stage runs: this machine, a plan of what a cluster would run, a Kubernetes "
          "cluster through kubectl, a Slurm cluster through sbatch/srun"),
    Param("plan_for", "one of " + ", ".join(CLUSTER_PLACES), one_of(CLUSTER_PLACES),
          {"*": "kube"}, "context plan: the place planned for (its manifests or batch scripts)"),
    Param("run_id", "'' (a new run) or letters, digits, '.', '_', '-' (1-64 chars, starting "
          "with a letter or digit, no '..')", run_id, {"*": ""}, "the run to record into"),
    Param("results_dir", "a directory path", results_dir, {"*": "results"},
          "where run directories live (relative to the repository)"),
    Param("seed", "an integer >= 0", int_at_least(0), {"*": 0}, "seed of every random draw"),
    Param("nodes", "an integer >= 1 (1 on the local context)", int_at_least(1),
          {"local": 1, **_cluster(2)}, "nodes in the run"),
    Param("instance_type", "one of " + ", ".join(INSTANCE_TYPES), one_of(INSTANCE_TYPES),
          _cluster(DEFAULT_INSTANCE_TYPE),
          "the nodes' instance type; gpus_per_node and efa_per_node default to what it has"),
    Param("gpus_per_node", "an integer from 0 to 16", int_range(0, 16), {},
          "GPUs per node (local: detected; a cluster: the instance type's)"),
    Param("efa_per_node", "an integer from 0 to 64", int_range(0, 64), {},
          "EFA devices per node (a cluster: the instance type's; p5en 16, p5 32)"),
    Param("kube_context", "'' (kubectl's current context) or a kubectl context name (letters, "
          "digits, '.', '_', ':', '/', '@', '-')", optional(matching(KUBE_CONTEXT_RULE)),
          {"*": ""}, "kubectl context"),
    Param("namespace", "a Kubernetes namespace (DNS-1123 label: lower-case letters, digits, "
          "'-', at most 63)", matching(DNS1123_LABEL), {"*": "deepep-repro"}, "namespace"),
    Param("image", "'' or an image by digest (repo@sha256:...) or by a tag other than 'latest'",
          optional(matching(IMAGE_RULE)), {"*": ""},
          "the image the cluster runs (kube: a pod's image; slurm: pyxis's --container-image); "
          "built by 02 from pins.yaml"),
    Param("venv", "'' or a path (absolute, or relative to the repository), no '..'",
          optional(lambda v: v if isinstance(v, str) and "\x00" not in v and ".." not in v
                   else _bad()),
          {"*": ""}, "slurm: a Python environment on the nodes' shared file system, used when "
                     "no image is given (relative: inside the checkout, which the nodes share)"),
    Param("partition", "'' or a Slurm partition name", optional(matching(SLURM_NAME_RULE)),
          {"*": ""}, "slurm: the partition ('' the cluster's default)"),
    Param("account", "'' or a Slurm account name", optional(matching(SLURM_NAME_RULE)),
          {"*": ""}, "slurm: the account ('' none)"),
    Param("time_limit_min", "an integer from 1 to 10080 (a week)", int_range(1, 10080),
          {"*": 60}, "slurm: each step's time limit"),
    Param("schedule_timeout_s", "a number of seconds > 0", float_above(0), {"*": 900.0},
          "kube and slurm: how long pods or an allocation may wait to be scheduled and start"),
    Param("job_timeout_s", "a number of seconds > 0", float_above(0), {"*": 3600.0},
          "kube and slurm: how long a one-shot job (test_ep, AIPerf, a probe) may run"),
    Param("keep", "true or false", boolean, {"*": False},
          "kube and slurm: leave the serve up for the next stage (else every object or job of "
          "the run is deleted when the stage ends)"),
    # 03 kernel test (DeepEP test_ep's meaning)
    Param("ranks", "an integer from 1 to 64 (at least 2 on the local context)", int_range(1, 64),
          {"local": 2}, "processes per node (local: 2; a cluster: every GPU of a node, or 1 "
                        "on a node without GPUs)"),
    Param("num_tokens", "an integer >= 1", int_at_least(1), {"*": 128}, "tokens per rank"),
    Param("hidden", "an integer >= 1", int_at_least(1), _cluster(7168),
          "hidden size (local: 7168 on GPUs, 256 on CPU)"),
    Param("num_topk", "an integer >= 1, <= num_experts", int_at_least(1), {"*": 8}, "top-k"),
    Param("num_experts", "an integer >= 1, divisible by the ranks", int_at_least(1),
          {"*": 256}, "experts"),
    Param("num_comms", "an integer from 1 to 16", int_range(1, 16), {"*": 1},
          "communicators the all-to-all is striped over (EP_NUM_COMMS; the multicomm overlay "
          "holds at most 16)"),
    Param("iters", "an integer >= 1", int_at_least(1), {"local": 30, "*": 50}, "timed iterations"),
    Param("warmup", "an integer >= 0", int_at_least(0), {"*": 5}, "untimed iterations"),
    # DeepEP itself on a GPU machine (local): 03 runs its test_ep beside the torch benchmark
    Param("deepep_dir", "'' (none) or the path of a DeepEP checkout built in place "
          "(docker/build_deepep.sh)", text, {"*": ""},
          "DeepEP built on this machine (local, 2+ GPUs): 03 runs its tests/elastic/test_ep.py, "
          "vLLM's deepep_* backends import it"),
    Param("nccl_site", "'' (none) or a site-packages folder holding nvidia-nccl-cu13 2.30.4",
          text, {"*": ""}, "the NCCL DeepEP was built for, preloaded intranode (lib.engines.transport)"),
    Param("test_ep_tokens", "a list of integers >= 1, e.g. '128,512,4096'", int_list,
          {"*": [128, 512, 4096]}, "tokens per rank of each test_ep run (and the torch "
                                   "benchmark beside it)"),
    # 04 serve
    Param("engine", "one of " + ", ".join(ENGINES) + " ('' picks by place)",
          optional(one_of(ENGINES)), {"*": ""},
          "serving engine ('' : vLLM on a cluster place; on local, vLLM where it imports and 2+ "
          "GPUs are present, else transformers serve)"),
    Param("model", "an org/name model id", matching(MODEL_ID_RULE), _cluster(_MODEL_PIN["model"]),
          "the cluster's model (local serves a seeded model built here)"),
    Param("model_revision", "'' or a 40-hex commit", optional(matching(
          __import__("re").compile(r"^[0-9a-f]{40}$"))), _cluster(_MODEL_PIN["revision"]),
          "the model's revision (pins.yaml `model`)"),
    Param("model_cache_dir", "'' or an absolute path on the nodes",
          optional(lambda v: v if str(v).startswith("/") and "\x00" not in v
                   and ".." not in v else _bad()), {"*": ""},
          "kube: where the nodes keep model weights, on their NVMe instance storage (a hostPath;"
          " not a per-pod emptyDir on the root volume); required to serve on kube"),
    Param("hf_token_secret", "'' or a Kubernetes Secret name (DNS-1123 label)",
          optional(matching(DNS1123_LABEL)), {"*": ""},
          "kube: the Secret holding HF_TOKEN (key 'token'); a token value is never a parameter"),
    Param("workload", "one of " + ", ".join(WORKLOADS), one_of(WORKLOADS), {"*": "statefulset"},
          "kube: the serve as a StatefulSet, or as a LeaderWorkerSet (rendered and checked "
          "only: it needs the LWS controller)"),
    Param("enforce_eager", "true or false", boolean, {"*": True},
          "vLLM --enforce-eager (false: torch.compile and CUDA graphs)"),
    Param("server_timeout_s", "a number of seconds > 0", float_above(0),
          {"local": 180.0, "local:vllm": 900.0, "*": 1800.0},
          "how long to wait for the server to be ready"),
    Param("model_layers", "an integer >= 1", int_at_least(1), {"*": 2},
          "decoder layers of the seeded model (both engines; the per-layer shape is the engine's)"),
    Param("all2all_backend", "one of " + ", ".join(ALL2ALL_BACKENDS), one_of(ALL2ALL_BACKENDS),
          {"local": "allgather_reducescatter", "*": "deepep_v2"},
          "vLLM's --all2all-backend (engine vllm; deepep_* needs DeepEP built here)"),
    # 05 sweep
    Param("concurrency", "a list of integers >= 1, e.g. '1,2,4'", int_list,
          {"local": [1, 2, 4], "local:vllm": [4, 8, 32], **_cluster([4, 8, 32])},
          "concurrency levels"),
    Param("request_count", "an integer >= 1", int_at_least(1),
          {"local": 16, "local:vllm": 48, "*": 128},
          "measured requests per cell"),
    Param("requests_per_slot", "an integer >= 0", int_at_least(0), {"*": 5},
          "each cell measures at least this many requests per concurrency slot: "
          "max(request_count, requests_per_slot x concurrency), the public review's 5x "
          "requests per level (48 requests at concurrency 32 are one and a half waves, mostly "
          "ramp and tail); 0: request_count at every level", legacy=0),
    Param("warmup_requests", "an integer >= 0", int_at_least(0),
          {"local": 2, "local:vllm": 8, "*": 16},
          "unmeasured warmup requests per cell"),
    Param("warmup_full_batch", "true or false", boolean, {"*": True},
          "each cell's warmup is at least its concurrency, so the first full batch (and the "
          "kernels compiled for its shapes) is not measured; false: warmup_requests as given",
          legacy=False),
    Param("repeats", "an integer >= 1", int_at_least(1), {"*": 3}, "repeats per cell"),
    Param("input_tokens", "an integer >= 1", int_at_least(1),
          {"local": 64, "local:vllm": 120, "*": 120},
          "synthetic input tokens (mean)"),
    Param("output_tokens", "an integer >= 1", int_at_least(1),
          {"local": 16, "local:vllm": 128, "*": 128},
          "output tokens per request"),
    Param("ab_backends", "'' (none) or two or more of " + ", ".join(ALL2ALL_BACKENDS)
          + ", comma-separated, the first the baseline", choice_list(ALL2ALL_BACKENDS),
          {"*": []},
          "05 with engine vllm: these backends side by side, arms interleaved, both traffic "
          "shapes (deepep_v2 vs allgather_reducescatter)"),
    Param("prefill_input_tokens", "an integer >= 1", int_at_least(1), {"*": 1536},
          "the prefill-heavy traffic shape of the backend A/B: input tokens"),
    Param("prefill_output_tokens", "an integer >= 1", int_at_least(1), {"*": 16},
          "the prefill-heavy traffic shape of the backend A/B: output tokens"),
    Param("answer_prompts", f"an integer from 0 to {len(ANSWER_PROMPTS)}",
          int_range(0, len(ANSWER_PROMPTS)), {"*": len(ANSWER_PROMPTS)},
          "engine vllm, arms side by side (05's backend A/B, 06): each arm is asked this many "
          "fixed prompts (greedy, top logprobs) before its cells, and each compared arm must "
          "answer as the baseline does (lib.measure.agreement); 0: not asked", legacy=0),
    # 06 levers
    Param("arm_a_comms", "an integer from 1 to 16", int_range(1, 16), {"*": 1},
          "arm A communicators (EP_NUM_COMMS)"),
    Param("arm_b_comms", "an integer from 1 to 16", int_range(1, 16), {"*": 8},
          "arm B communicators (EP_NUM_COMMS)"),
    Param("ab_repeats", "an integer >= 2", int_at_least(2),
          {"local": 5, "local:vllm": 3, "*": 5},
          "repeats per arm, interleaved"),
]
PARAMS = {p.name: p for p in _PARAMS}


def _bad():
    raise ValueError


COMMON = ("context", "run_id", "results_dir", "seed", "nodes", "gpus_per_node", "kube_context",
          "namespace")
PLACE = ("plan_for", "instance_type", "efa_per_node", "image", "venv", "partition", "account",
         "time_limit_min", "schedule_timeout_s", "job_timeout_s", "keep")
SERVE = ("engine", "server_timeout_s", "model_layers", "all2all_backend", "nccl_site",
         "deepep_dir", "model", "model_revision", "model_cache_dir", "hf_token_secret", "workload",
         "enforce_eager", "num_comms")
TRAFFIC = ("concurrency", "request_count", "requests_per_slot", "warmup_requests",
           "warmup_full_batch", "input_tokens", "output_tokens")
KERNEL = ("ranks", "num_tokens", "hidden", "num_topk", "num_experts", "num_comms", "iters",
          "warmup")
DEEPEP = ("deepep_dir", "nccl_site", "test_ep_tokens")


def _unique(*groups: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(name for group in groups for name in group))


SPECS = {s.name: s for s in (
    StageSpec("00_cluster", "cluster", "Cluster: can this context run the guide?",
              "the context can run the guide: per node, CPU, memory, GPUs, EFA devices, gdrdrv, "
              "hugepages, and on a cluster kubectl or Slurm access and expert-parallel "
              "divisibility",
              _unique(COMMON, PLACE, ("model", "engine")), ()),
    StageSpec("01_public_roots", "roots",
              "Public roots: does every pin resolve at its public source?",
              "every pin in `pins.yaml` resolves at its public source (git SHAs, PyPI versions, "
              "image tags, installer, HF revision; PR-head drift)",
              COMMON, ("00_cluster",), uses_place=False),
    StageSpec("02_image", "image", "Image: is the image what the pins say?",
              "the Dockerfile is what the pins say: hadolint, shellcheck, ARGs equal pins; the "
              "build where a Docker engine exists",
              _unique(COMMON, PLACE), ("00_cluster", "01_public_roots")),
    StageSpec("03_kernel_test", "kernel", "Kernel test: does the all-to-all work, and how fast?",
              "the all-to-all works and how fast: dispatch/combine with correctness checked, "
              "p50/p99, beside the bare all-to-all floor",
              _unique(COMMON, PLACE, KERNEL, DEEPEP), ("00_cluster",)),
    StageSpec("04_serve", "serve", "Serve: does an MoE model answer over this transport?",
              "an MoE model serves: ready, lists the model, is an MoE, answers chat with usage; "
              "with vLLM, its logs prove the all-to-all backend, the EP split, eager or graphs, "
              "and every rank's NCCL init",
              _unique(COMMON, PLACE, SERVE), ("00_cluster",)),
    StageSpec("05_sweep", "sweep", "Sweep: how fast does it serve?",
              "how fast it serves: AIPerf per concurrency x repeat, at least 5 requests per "
              "concurrency slot, warmup excluded, every cell gated (with vLLM also by its own "
              "token counter); with `ab_backends`, the backend A/B",
              _unique(COMMON, PLACE, SERVE, TRAFFIC, ("repeats", "ab_backends",
                                                      "prefill_input_tokens",
                                                      "prefill_output_tokens", "answer_prompts")),
              ("00_cluster", "04_serve")),
    StageSpec("06_multicomm", "lever",
              "Levers: EP_NUM_COMMS, and on one GPU host eager vs CUDA graphs and EP vs no EP",
              "the levers as interleaved A/Bs with repeats and a ratio with its bootstrap "
              "interval: EP_NUM_COMMS 1 vs 8 (a cluster; on CPU the benchmark's K "
              "communicators); with vLLM on one host, eager vs CUDA graphs and EP vs no EP",
              _unique(COMMON, PLACE, KERNEL, ("arm_a_comms", "arm_b_comms", "ab_repeats"), SERVE,
                      TRAFFIC, ("answer_prompts",)),
              ("00_cluster", "03_kernel_test"), reads_when_serving=("00_cluster", "04_serve")),
)}
STAGES = tuple(SPECS)
STAGE_PARAMS: dict[str, tuple[str, ...]] = {name: spec.params for name, spec in SPECS.items()}


# ---- resolving ---------------------------------------------------------------------------------
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
    checked(PARAMS["context"], context)
    engine = given.get("engine") or ""
    resolved: dict[str, Any] = {}
    for name in names:
        value = given.get(name)
        if value is None:
            value = PARAMS[name].default(context, engine)
        resolved[name] = None if value is None else checked(PARAMS[name], value)
    _derive(resolved)
    _check_together(resolved)
    return resolved


def _derive(p: dict[str, Any]) -> None:
    """Defaults that follow from another parameter: a cluster's GPUs and EFA devices per node
    from its instance type (an explicit value wins)."""
    kind = INSTANCE_TYPES.get(p.get("instance_type") or "")
    if kind is None:
        return
    if "gpus_per_node" in p and p["gpus_per_node"] is None:
        p["gpus_per_node"] = kind.gpus
    if "efa_per_node" in p and p["efa_per_node"] is None:
        p["efa_per_node"] = kind.efa


def check_run_request(context: str, run_id_: str | None, stages: list[str] | None,
                      given: dict[str, Any]) -> None:
    """What `python -m lib.runner run` was asked, checked before the run directory exists.

    Each stage checks its own parameters again, together, in its first cell; this catches
    what would otherwise leave an empty or misplaced run behind: a run id that is a path, an
    unknown context or stage, a parameter no selected stage takes, a value its rule refuses."""
    checked(PARAMS["context"], context)
    if run_id_ is not None:
        checked(PARAMS["run_id"], run_id_)
        if not run_id_:
            raise ParameterError("run_id", run_id_, PARAMS["run_id"].allowed.replace(
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
        checked(PARAMS[name], value)


def _check_together(p: dict[str, Any]) -> None:
    """Rules across parameters: said in terms of the parameter a person would change."""
    context = p.get("context")
    if context == "local" and p.get("nodes") not in (None, 1):
        raise ParameterError("nodes", p["nodes"], "1 on the local context (more needs a cluster: "
                                                  "kube or slurm)")
    experts, topk = p.get("num_experts"), p.get("num_topk")
    if experts is not None and topk is not None and topk > experts:
        raise ParameterError("num_topk", topk, f"an integer from 1 to num_experts ({experts})")
    if context == "local" and p.get("ranks") is not None and p["ranks"] < 2:
        raise ParameterError("ranks", p["ranks"], "an integer >= 2 on the local context (one "
                                                  "machine: the all-to-all needs two ranks)")
    ranks = p.get("ranks") if context == "local" else _world(p)
    if experts is not None and ranks and experts % ranks:
        raise ParameterError("num_experts", experts,
                             f"a multiple of the ranks ({ranks}) so every rank holds whole experts")
    _check_model_divides(p)
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
        if (context == "local" and p.get("engine") != "transformers"
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


def _check_model_divides(p: dict[str, Any]) -> None:
    """Expert parallelism needs the model's routed experts divisible by the EP size (nodes x
    GPUs per node on a cluster): `-p nodes 3` with the default model is refused here."""
    model = p.get("model")
    if p.get("context") == "local" or not model or not p.get("nodes") or not p.get("gpus_per_node"):
        return
    experts = routed_experts(model)
    world = p["nodes"] * p["gpus_per_node"]
    if experts is not None and experts % world:
        divisors = [n for n in range(1, 17) if experts % (n * p["gpus_per_node"]) == 0]
        raise ParameterError(
            "nodes", p["nodes"],
            f"a node count whose EP size divides the model's routed experts (expert parallelism "
            f"divisibility): {model} has {experts} routed experts, and {p['nodes']} nodes x "
            f"{p['gpus_per_node']} GPUs = {world} ranks does not divide them; nodes in "
            + ", ".join(map(str, divisors)))


def _world(p: dict[str, Any]) -> int | None:
    """The ranks of a cluster job: nodes x processes per node (`ranks`, else its GPUs)."""
    per_node = p.get("ranks") or p.get("gpus_per_node")
    if p.get("nodes") and per_node:
        return p["nodes"] * per_node
    return None


def serving(stage: str, engine: str) -> bool:
    """Whether `stage` serves with these resolved values: 06 measures a serving A/B when the
    engine is vLLM (and always on a cluster place, whose engine is vLLM)."""
    return engine == "vllm"


def upstream(stage: str, engine: str = "") -> tuple[str, ...]:
    """The stages whose evidence `stage` reads (a FAIL there blocks it)."""
    return SPECS[stage].upstream(serving(stage, engine))
