"""The one stage registry and the one parameter table.

Every reader of "which stages exist, what each takes, what each reads" reads this module: the
stage opener (lib.stages.opening), the runner (order and blocking), the notebook writer
(parameters cells, titles), the report and book (stage pages, _toc.yml), the README's stage
table (tests/test_registry.py compares them).

`resolve(stage, given)` turns a notebook's parameters into validated values: given values win,
None takes the context's default; a refused value raises ParameterError naming the parameter and
its allowed values, before any effect. Every bound is a named constant below, said once with
why; `parameter_bounds_table()` lists every parameter's stages, type, allowed values (the words
its refusal says) and defaults, for the book and the README.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lib.core.door import REPO_ROOT
from lib.core.errors import ParameterError
from lib.core import param_model
from lib.core.param_model import StageParameters
from lib.core.params import (COMMIT, IMAGE, KUBE_CONTEXT, MODEL_ID, RUN_ID, SLURM_NAME,
                             ChoiceList, Flag, Folder, Integer, IntList, Number, OneOf, OrEmpty,
                             Param, checked, dns_label)
from lib.engines import catalog
from lib.engines import megatron
from lib.engines import transport as transport_mod
from lib.engines.deepep import DEFAULT_MODE as DEFAULT_DEEPEP_V2_MODE, MODES as DEEPEP_V2_MODES
from lib.engines.vllm_args import BACKENDS as ALL2ALL_BACKENDS, MAX_EP_NUM_COMMS
from lib.measure import sweep
from lib.measure.agreement import PROMPTS as ANSWER_PROMPTS
from lib import places
from lib.places.instances import DEFAULT_INSTANCE_TYPE, INSTANCE_TYPES
from lib.roots import pins as pins_mod
from lib.stages.rules_engines import check_ep_divides, check_pin_set
from lib.stages.rules_places import check_places
from lib.stages.specs import place_spec_of

CONTEXTS = ("local", "plan", "kube", "slurm")
# lib.stages.profile's how-to (said here too: the profile module reads this one, not the reverse)
PROFILE_HOW = ("python -m lib.runner profile --context kube -p kube_context <context> "
               "-p namespace <namespace> -p image <image> -p model_cache_dir <dir>, or "
               "--context slurm -p partition <partition> ...; or pass -p context kube|slurm")
CLUSTER_PLACES = ("kube", "slurm")  # what `plan` can plan for
ENGINES = tuple(sorted(catalog.ENGINES))
# srun --mpi's plugins (Slurm's mpi/ plugin names; pmix_vN where more than one PMIx is built)
SLURM_MPI_PLUGINS = ("pmix", "pmix_v3", "pmix_v4", "pmix_v5", "pmi2", "cray_shasta", "none")
WORKLOADS = ("statefulset", "leaderworkerset")
_CLUSTER = ("plan", "kube", "slurm")  # contexts that serve a real model on p5en-class nodes
_MODEL_PIN = pins_mod.load()["pins"]["model"]  # the one source of the cluster model and revision
# the AIPerf a cluster's cells run (the image's) and the local sweep tool's, for prompt_corpus
_AIPERF_IMAGE, _AIPERF_LOCAL = (pins_mod.load()["pins"][name]["version"]
                                for name in ("aiperf_public", "aiperf_local"))


def _sets_pinning(pin: str) -> list[str]:
    """The pin sets (file order) that hold `pin`."""
    return [name for name in pins_mod.set_names(_PINS) if pin in pins_mod.set_pins(_PINS, name)]


def _pin_set_defaults() -> dict[str, str]:
    """The base set, and for an engine the base set does not pin, the first set that does."""
    base = pins_mod.base_set(_PINS)
    defaults = {"*": base}
    for name, engine in catalog.ENGINES.items():
        sets = _sets_pinning(engine.pin) if engine.pin else []
        if sets and base not in sets:
            defaults[f"*:{name}"] = sets[0]
    return defaults
_PINS = pins_mod.load()  # the pin sets `pin_set` chooses among, and its default (the base set)


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


# ---- bounds: each once, with why -----------------------------------------------------------------
MAX_GPUS_PER_NODE = max(t.gpus for t in INSTANCE_TYPES.values())  # 8 on p5en and p5
MAX_EFA_PER_NODE = max(t.efa for t in INSTANCE_TYPES.values())  # 32 on p5
# 32 p5en are 256 GPUs: DeepSeek-V3's 256 routed experts one per rank (the guide's own model,
# 128 experts, divides over at most 16 nodes: _check_model_divides)
MAX_NODES = 32
MAX_WAIT_S = 7 * 24 * 3600  # a week: the longest Slurm time limit allowed here, and any wait
MIN_WAIT_S = 1  # a timeout under a second is no wait at all
MAX_SEED = 2 ** 32 - 1  # numpy's seeds are below 2**32
MAX_TOKENS_PER_RANK = 16384  # four times the largest test_ep case the guide runs (4096)
MAX_TEST_EP_CASES = 8  # test_ep runs per stage (three by default)
# above any public MoE's hidden size (DeepSeek-V3's and Kimi K2's 7168, the shape tested here)
MAX_HIDDEN = 16384
MAX_EXPERTS = 1024  # twice Qwen3-Next's 512 routed experts
MAX_TOPK = 32  # over three times Qwen3-Next's 10 (DeepSeek-V3 and Qwen3 route to 8)
MAX_ITERATIONS = 10_000  # of the kernel benchmark: 50 are timed by default
MAX_LAYERS = 128  # above Qwen3-235B-A22B's 94 decoder layers and DeepSeek-V3's 61
# 256 requests in flight on each GPU of two p5en (16 GPUs), far past where a serve saturates
# (the cluster default sweeps 4, 8, 32)
MAX_CONCURRENCY = 4096
MAX_LEVELS = 16  # concurrency levels of one sweep (the powers of two to 4096 are 13)
MAX_REQUESTS = 100_000  # measured requests of one cell: 12.8 million tokens out at the default 128
# a cell at the largest concurrency still measures at most MAX_REQUESTS requests
MAX_REQUESTS_PER_SLOT = MAX_REQUESTS // MAX_CONCURRENCY
MAX_REPEATS = 100  # repeats of a cell or of an A/B arm (3 and 5 by default)
MAX_SEQUENCE_TOKENS = 131072  # Qwen3-30B-A3B's context with YaRN (32768 native)
# 07 training: a short run of a small model, each bound said with why
MAX_TRAIN_STEPS = 1000  # a few steps prove the path; a thousand is a real run's first hour
MAX_TRAIN_HIDDEN = 8192  # above Qwen3-235B-A22B's 4096 and the public gate's 2048
MAX_TRAIN_VOCAB = 262144  # Gemma 3's, the largest public vocabulary (Qwen3: 151936)
MAX_TRAIN_BATCH = 1024  # sequences per rank and step
MIN_TRAIN_LR, MAX_TRAIN_LR = 1e-7, 1.0  # Adam's learning rates in use span 1e-6 to 1e-2


def _seconds() -> Number:
    return Number(MIN_WAIT_S, MAX_WAIT_S, "seconds (a week)")


def _software_folder(absolute: bool = True) -> Folder:
    """A folder a run reads (an environment, a build, a site of packages), on this machine or
    the nodes."""
    return Folder(absolute=absolute, written=False, here=False, base=REPO_ROOT)


# ---- the parameter table -----------------------------------------------------------------------
_PARAMS = [
    Param("context", OneOf(CONTEXTS), {"*": "local"},
          "where the stage runs: this machine, a plan of what a cluster would run, a Kubernetes "
          "cluster through kubectl, a Slurm cluster through sbatch/srun"),
    Param("plan_for", OneOf(CLUSTER_PLACES), {"*": "kube"},
          "context plan: the place planned for (its manifests or batch scripts)"),
    Param("run_id", OrEmpty(RUN_ID, "a new run"), {"*": ""}, "the run to record into"),
    Param("results_dir", Folder(absolute=False, written=True, here=True, base=REPO_ROOT),
          {"*": "results"}, "where run directories live (relative to the repository)"),
    Param("seed", Integer(0, MAX_SEED), {"*": 0}, "seed of every random draw"),
    Param("pin_set", OneOf(tuple(pins_mod.set_names(_PINS))), _pin_set_defaults(),
          "the pin set (pins.yaml `sets:`) the run uses, recorded in run.json; 01 verifies "
          "every set"),
    Param("nodes", Integer(1, MAX_NODES), {"local": 1, **_cluster(2)}, "nodes in the run",
          together="1 on the local context"),
    Param("instance_type", OneOf(tuple(INSTANCE_TYPES)), _cluster(DEFAULT_INSTANCE_TYPE),
          "the nodes' instance type; gpus_per_node and efa_per_node default to what it has"),
    Param("gpus_per_node", Integer(0, MAX_GPUS_PER_NODE), {},
          "GPUs per node (local: detected; a cluster: the instance type's)"),
    Param("efa_per_node", Integer(0, MAX_EFA_PER_NODE), {},
          "EFA devices per node (a cluster: the instance type's; p5en 16, p5 32)"),
    Param("kube_context", OrEmpty(KUBE_CONTEXT, "kubectl's current context"), {"*": ""},
          "kubectl context"),
    Param("namespace", dns_label("a Kubernetes namespace"), {"*": "deepep-repro"}, "namespace"),
    Param("image", OrEmpty(IMAGE, "none"), {"*": ""},
          "the image the cluster runs (kube: a pod's image; slurm: pyxis's --container-image); "
          "built by 02 from pins.yaml"),
    Param("venv", OrEmpty(_software_folder(absolute=False), "none"), {"*": ""},
          "slurm: a Python environment on the nodes' shared file system, used when "
          "no image is given (relative: inside the checkout, which the nodes share)"),
    Param("partition", OrEmpty(SLURM_NAME, "the cluster's default"), {"*": ""},
          "slurm: the partition ('' the cluster's default)"),
    Param("account", OrEmpty(SLURM_NAME, "none"), {"*": ""}, "slurm: the account ('' none)"),
    Param("slurm_mpi", OneOf(SLURM_MPI_PLUGINS), {"*": "pmix"},
          "slurm: srun's --mpi plugin for an engine launched as one MPI world (TensorRT-LLM: "
          "a task per GPU); `srun --mpi=list` names the cluster's"),
    Param("time_limit_min", Integer(1, MAX_WAIT_S // 60, "minutes (a week)"), {"*": 60},
          "slurm: each step's time limit"),
    Param("schedule_timeout_s", _seconds(), {"*": 900.0},
          "kube and slurm: how long pods or an allocation may wait to be scheduled and start"),
    Param("job_timeout_s", _seconds(), {"*": 3600.0},
          "kube and slurm: how long a one-shot job (test_ep, AIPerf, a probe) may run"),
    Param("transport", OneOf(transport_mod.TRANSPORTS),
          {"local": "intranode_nvlink", **_cluster("efa")},
          "the transport contract of the GPU processes (lib.engines.transport): efa = NCCL GIN "
          "type 2, the CPU proxy over EFA (the published runs); gin_type5 = GIN type 5, "
          "the GPU-initiated EFA path AWS's benchmark runs (needs a pin set with NCCL >= 2.31 "
          "and EFA installer >= 1.50); intranode_nvlink = one machine's NVLink with GIN off",
          together="intranode_nvlink on the local context, efa or gin_type5 on a cluster; "
                   "gin_type5 only with a pin set that reaches its floor"),
    Param("keep", Flag(), {"*": False},
          "kube and slurm: leave the serve up for the next stage (else every object or job of "
          "the run is deleted when the stage ends)"),
    # 03 kernel test (DeepEP test_ep's meaning)
    Param("ranks", Integer(1, MAX_GPUS_PER_NODE), {"local": 2},
          "processes per node (local: 2; a cluster: every GPU of a node, or 1 "
          "on a node without GPUs)", together="at least 2 on the local context"),
    Param("num_tokens", Integer(1, MAX_TOKENS_PER_RANK), {"*": 128}, "tokens per rank"),
    Param("hidden", Integer(1, MAX_HIDDEN), _cluster(7168),
          "hidden size (local: 7168 on GPUs, 256 on CPU)"),
    Param("num_topk", Integer(1, MAX_TOPK), {"*": 8}, "top-k", together="<= num_experts"),
    Param("num_experts", Integer(1, MAX_EXPERTS), {"*": 256}, "experts",
          together="divisible by the ranks"),
    Param("num_comms", Integer(1, MAX_EP_NUM_COMMS), {"*": 1},
          "communicators the all-to-all is striped over (EP_NUM_COMMS; the multicomm overlay "
          f"holds at most {MAX_EP_NUM_COMMS})"),
    Param("iters", Integer(1, MAX_ITERATIONS), {"local": 30, "*": 50}, "timed iterations"),
    Param("warmup", Integer(0, MAX_ITERATIONS), {"*": 5}, "untimed iterations"),
    # DeepEP itself on a GPU machine (local): 03 runs its test_ep beside the torch benchmark
    Param("deepep_dir", OrEmpty(_software_folder(), "none"), {"*": ""},
          "DeepEP built on this machine (local, 2+ GPUs; docker/build_deepep.sh): 03 runs its "
          "tests/elastic/test_ep.py, vLLM's deepep_* backends import it"),
    Param("nccl_site", OrEmpty(_software_folder(), "none"), {"*": ""},
          "a site-packages folder holding nvidia-nccl-cu13 2.30.4: the NCCL DeepEP was built "
          "for, preloaded intranode (lib.engines.transport)"),
    Param("test_ep_tokens", IntList(Integer(1, MAX_TOKENS_PER_RANK), MAX_TEST_EP_CASES,
                                    "128,512,4096"),
          {"*": [128, 512, 4096]}, "tokens per rank of each test_ep run (and the torch "
                                   "benchmark beside it)"),
    Param("transport_ab", Flag(), {"*": False},
          "03 on a cluster: test_ep at each token count over GIN type 2 (efa) and GIN type 5 "
          "(gin_type5) alike, interleaved over ab_repeats, with the ratio type 5 / type 2 and "
          "its interval (lib.stages.transport_ab)",
          together="a cluster place and a pin set that reaches GIN type 5's floor"),
    # 04 serve
    Param("engine", OrEmpty(OneOf(ENGINES), "picks by place"), {"*": ""},
          "serving engine ('' : vLLM on a cluster place; on local, vLLM where it imports and 2+ "
          "GPUs are present, else transformers serve)"),
    Param("model", MODEL_ID, _cluster(_MODEL_PIN["model"]),
          "the cluster's model (local serves a seeded model built here)"),
    Param("model_revision", OrEmpty(COMMIT, "the Hub's current one"),
          _cluster(_MODEL_PIN["revision"]), "the model's revision (pins.yaml `model`)"),
    Param("model_cache_dir", OrEmpty(Folder(absolute=True, written=True, here=False), "none"),
          {"*": ""},
          "kube: where the nodes keep model weights, on their NVMe instance storage (a hostPath;"
          " not a per-pod emptyDir on the root volume); required to serve on kube"),
    Param("hf_token_secret", OrEmpty(dns_label("a Kubernetes Secret name"), "none"), {"*": ""},
          "kube: the Secret holding HF_TOKEN (key 'token'); a token value is never a parameter"),
    # named for the place it shapes, as kube_context is
    Param("kube_workload", OneOf(WORKLOADS), {"*": "statefulset"},
          "kube: the serve as a StatefulSet, or as a LeaderWorkerSet (one group of `nodes` "
          "pods; needs the LeaderWorkerSet controller in the cluster)"),
    Param("enforce_eager", Flag(), {"*": True},
          "vLLM --enforce-eager (false: torch.compile and CUDA graphs)"),
    Param("server_timeout_s", _seconds(), {"local": 180.0, "local:vllm": 900.0, "*": 1800.0},
          "how long to wait for the server to be ready"),
    Param("model_layers", Integer(1, MAX_LAYERS), {"*": 2},
          "decoder layers of the seeded model (both engines; the per-layer shape is the engine's)"),
    Param("deepep_v2_mode", OneOf(DEEPEP_V2_MODES), {"*": DEFAULT_DEEPEP_V2_MODE},
          "DeepEP-V2's mode with all2all_backend deepep_v2: hybrid (scale-out and scale-up "
          "ranks in two stages, as the published runs set it) or direct; set explicitly, since "
          "the same argv selects different kernels across vLLM releases (vLLM #54281, #57991): "
          "vLLM reads VLLM_DEEPEP_V2_ALLOW_HYBRID_MODE (1 or 0), SGLang --deepep-v2-mode"),
    Param("all2all_backend", OneOf(ALL2ALL_BACKENDS),
          {"local": "allgather_reducescatter", "*": "deepep_v2"},
          "vLLM's --all2all-backend (engine vllm; deepep_* needs DeepEP built here)"),
    # 05 sweep
    Param("concurrency", IntList(Integer(1, MAX_CONCURRENCY), MAX_LEVELS, "1,2,4"),
          {"local": [1, 2, 4], "local:vllm": [4, 8, 32], **_cluster([4, 8, 32])},
          "concurrency levels"),
    Param("request_count", Integer(1, MAX_REQUESTS), {"local": 16, "local:vllm": 48, "*": 128},
          "measured requests per cell"),
    Param("requests_per_slot", Integer(0, MAX_REQUESTS_PER_SLOT), {"*": 5},
          "each cell measures at least this many requests per concurrency slot: "
          "max(request_count, requests_per_slot x concurrency), the public review's 5x "
          "requests per level (48 requests at concurrency 32 are one and a half waves, mostly "
          "ramp and tail); 0: request_count at every level"),
    # a warmup longer than the largest concurrency's full batch warms nothing more
    Param("warmup_requests", Integer(0, MAX_CONCURRENCY), {"local": 2, "local:vllm": 8, "*": 16},
          "unmeasured warmup requests per cell"),
    Param("warmup_full_batch", Flag(), {"*": True},
          "each cell's warmup is at least its concurrency, so the first full batch (and the "
          "kernels compiled for its shapes) is not measured; false: warmup_requests as given"),
    Param("repeats", Integer(1, MAX_REPEATS), {"*": 3}, "repeats per cell"),
    Param("input_tokens", Integer(1, MAX_SEQUENCE_TOKENS),
          {"local": 64, "local:vllm": 120, "*": 120}, "synthetic input tokens (mean)"),
    Param("output_tokens", Integer(1, MAX_SEQUENCE_TOKENS),
          {"local": 16, "local:vllm": 128, "*": 128}, "output tokens per request"),
    Param("prompt_corpus", OneOf(sweep.PROMPT_CORPORA), {"*": sweep.DEFAULT_PROMPT_CORPUS},
          "the text of AIPerf's synthetic prompts (its --prompt-corpus): sonnet (Shakespeare, "
          f"AIPerf's default, the only one of the image's AIPerf {_AIPERF_IMAGE}), coding, or "
          "random (tokens drawn from the vocabulary, as vLLM bench's random dataset: no corpus "
          "to tokenize at each cell's start); coding and random on the local context only"),
    Param("ab_backends", ChoiceList(ALL2ALL_BACKENDS, 2, "'' (none) or two or more of "
                                    + ", ".join(ALL2ALL_BACKENDS)
                                    + ", distinct, comma-separated, the first the baseline"),
          {"*": []},
          "05 with engine vllm: these backends side by side, arms interleaved, both traffic "
          "shapes (deepep_v2 vs allgather_reducescatter)"),
    Param("prefill_input_tokens", Integer(1, MAX_SEQUENCE_TOKENS), {"*": 1536},
          "the prefill-heavy traffic shape of the backend A/B: input tokens"),
    Param("prefill_output_tokens", Integer(1, MAX_SEQUENCE_TOKENS), {"*": 16},
          "the prefill-heavy traffic shape of the backend A/B: output tokens"),
    Param("answer_prompts", Integer(0, len(ANSWER_PROMPTS)), {"*": len(ANSWER_PROMPTS)},
          "engine vllm, arms side by side (05's backend A/B, 06): each arm is asked this many "
          "fixed prompts (greedy, top logprobs) before its cells, and each compared arm must "
          "answer as the baseline does (lib.measure.agreement); 0: not asked"),
    # 06 levers
    Param("arm_a_comms", Integer(1, MAX_EP_NUM_COMMS), {"*": 1},
          "arm A communicators (EP_NUM_COMMS)"),
    Param("arm_b_comms", Integer(1, MAX_EP_NUM_COMMS), {"*": 8},
          "arm B communicators (EP_NUM_COMMS)", together="different from arm_a_comms"),
    Param("ab_repeats", Integer(2, MAX_REPEATS), {"local": 5, "local:vllm": 3, "*": 5},
          "repeats per arm, interleaved"),
    # 07 training (megatron-core): local is a CPU-sized model; a cluster's default is the public
    # gate's MoE block (hidden 2048, ffn 1024, 128 experts top-8; Qwen3-30B-A3B's shape)
    Param("train_steps", Integer(2, MAX_TRAIN_STEPS), {"*": 5},
          "training steps (each gated; the loss must fall from the first to the last)"),
    Param("train_layers", Integer(1, MAX_LAYERS), {"*": 2}, "decoder layers, each with an MoE"),
    Param("train_hidden", Integer(8, MAX_TRAIN_HIDDEN), {"local": 64, **_cluster(2048)},
          "hidden size", together="divisible by train_heads"),
    Param("train_ffn_hidden", Integer(8, MAX_TRAIN_HIDDEN), {"local": 128, **_cluster(1024)},
          "each expert's FFN hidden size"),
    Param("train_heads", Integer(1, 128), {"local": 4, **_cluster(16)}, "attention heads"),
    Param("train_experts", Integer(1, MAX_EXPERTS), {"local": 8, **_cluster(128)},
          "routed experts per MoE layer", together="divisible by the ranks (EP = world)"),
    Param("train_topk", Integer(1, MAX_TOPK), {"local": 2, **_cluster(8)}, "experts per token",
          together="<= train_experts"),
    Param("train_vocab", Integer(2, MAX_TRAIN_VOCAB), {"local": 128, **_cluster(4096)},
          "vocabulary of the synthetic sequences"),
    Param("train_seq_len", Integer(2, MAX_SEQUENCE_TOKENS), {"local": 32, **_cluster(1024)},
          "tokens per sequence"),
    Param("train_micro_batch", Integer(1, MAX_TRAIN_BATCH), {"local": 4, **_cluster(8)},
          "sequences per rank and step"),
    # the cluster's block diverged at 3e-3 on one H200 (loss 8.73 -> 9.62 in 5 steps,
    # results/gpu-1xh200-train-20261204) and fell at 3e-4 (8.73 -> 7.08 in 8, ...20261204b)
    Param("train_lr", Number(MIN_TRAIN_LR, MAX_TRAIN_LR, "a learning rate"),
          {"local": 3e-3, **_cluster(3e-4)}, "Adam's learning rate"),
    Param("train_dispatcher", OneOf(megatron.DISPATCHERS), {"*": "alltoall"},
          "megatron-core's moe_token_dispatcher_type (flex: DeepEP-V2 behind it, only with a "
          "megatron-core that has the ElasticBuffer path)"),
]
PARAMS = {p.name: p for p in _PARAMS}


COMMON = ("context", "run_id", "results_dir", "seed", "nodes", "gpus_per_node", "kube_context",
          "namespace", "pin_set")
PLACE = ("plan_for", "instance_type", "efa_per_node", "image", "venv", "partition", "account",
         "slurm_mpi", "time_limit_min", "schedule_timeout_s", "job_timeout_s", "keep")
SERVE = ("engine", "server_timeout_s", "model_layers", "all2all_backend", "nccl_site",
         "deepep_dir", "model", "model_revision", "model_cache_dir", "hf_token_secret",
         "kube_workload", "enforce_eager", "num_comms", "deepep_v2_mode")
TRAFFIC = ("concurrency", "request_count", "requests_per_slot", "warmup_requests",
           "warmup_full_batch", "input_tokens", "output_tokens", "prompt_corpus")
KERNEL = ("ranks", "num_tokens", "hidden", "num_topk", "num_experts", "num_comms", "iters",
          "warmup")
DEEPEP = ("deepep_dir", "nccl_site", "test_ep_tokens", "transport_ab", "ab_repeats")
# the stages whose GPU processes run over a transport contract (03's ranks, 04-06's serves, 07's
# training): `transport` picks it; 00 and 02 run none over one
TRANSPORT = ("transport",)
TRAIN = ("ranks", "train_steps", "train_layers", "train_hidden", "train_ffn_hidden",
         "train_heads", "train_experts", "train_topk", "train_vocab", "train_seq_len",
         "train_micro_batch", "train_lr", "train_dispatcher")


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
              _unique(COMMON, PLACE, TRANSPORT, KERNEL, DEEPEP), ("00_cluster",)),
    StageSpec("04_serve", "serve", "Serve: does an MoE model answer over this transport?",
              "an MoE model serves: ready, lists the model, is an MoE, answers chat with usage; "
              "with vLLM, its logs prove the all-to-all backend, the EP split, eager or graphs, "
              "and every rank's NCCL init",
              _unique(COMMON, PLACE, TRANSPORT, SERVE), ("00_cluster",)),
    StageSpec("05_sweep", "sweep", "Sweep: how fast does it serve?",
              "how fast it serves: AIPerf per concurrency x repeat, at least 5 requests per "
              "concurrency slot, warmup excluded, every cell gated (with vLLM also by its own "
              "token counter); with `ab_backends`, the backend A/B",
              _unique(COMMON, PLACE, TRANSPORT, SERVE, TRAFFIC, ("repeats", "ab_backends",
                                                      "prefill_input_tokens",
                                                      "prefill_output_tokens", "answer_prompts")),
              ("00_cluster", "04_serve")),
    StageSpec("06_multicomm", "lever",
              "Levers: EP_NUM_COMMS, and on one GPU host eager vs CUDA graphs and EP vs no EP",
              "the levers as interleaved A/Bs with repeats and a ratio with its bootstrap "
              "interval: EP_NUM_COMMS 1 vs 8 (a cluster; on CPU the benchmark's K "
              "communicators); with vLLM on one host, eager vs CUDA graphs and EP vs no EP",
              _unique(COMMON, PLACE, TRANSPORT, KERNEL, ("arm_a_comms", "arm_b_comms",
                                                         "ab_repeats"), SERVE,
                      TRAFFIC, ("answer_prompts",)),
              ("00_cluster", "03_kernel_test"), reads_when_serving=("00_cluster", "04_serve")),
    StageSpec("07_train", "train", "Train: do a training step's tokens cross ranks and back?",
              "a Megatron-core MoE GPT trains with its experts over every rank: every rank exits "
              "0, loss finite and falling, grad norm finite, tokens crossing ranks counted per "
              "step from the dispatcher, the dispatcher asked is the one that ran; on CPU the "
              "same seed twice gives the same losses",
              _unique(COMMON, PLACE, TRANSPORT, TRAIN), ("00_cluster",)),
)}
STAGES = tuple(SPECS)
STAGE_PARAMS: dict[str, tuple[str, ...]] = {name: spec.params for name, spec in SPECS.items()}


# ---- resolving ---------------------------------------------------------------------------------
def resolve(stage: str, given: dict[str, Any]) -> StageParameters:
    """The stage's typed, frozen parameters (its model, MODELS[stage]), built once: given values
    win, None takes the context's default; every field checked by its rule, then the rules
    across parameters; ParameterError before any effect."""
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
    values: dict[str, Any] = {}
    for name in names:
        value = given.get(name)
        values[name] = PARAMS[name].default(context, engine) if value is None else value
    return param_model.build(MODELS[stage], _derive(values))


def _derive(p: dict[str, Any]) -> dict[str, Any]:
    """Defaults that follow from another parameter: a cluster's GPUs and EFA devices per node
    from its instance type (an explicit value wins; an instance type its rule refuses derives
    nothing, and is refused by its field)."""
    kind = INSTANCE_TYPES.get(p.get("instance_type") or "") \
        if isinstance(p.get("instance_type"), str) else None
    if kind is None:
        return p
    p = dict(p)
    if "gpus_per_node" in p and p["gpus_per_node"] is None:
        p["gpus_per_node"] = kind.gpus
    if "efa_per_node" in p and p["efa_per_node"] is None:
        p["efa_per_node"] = kind.efa
    return p


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
    one_machine = "context" in p and places.on_one_machine(place_spec_of(p))
    if one_machine and p.get("nodes") not in (None, 1):
        raise ParameterError("nodes", p["nodes"], "1 on the local context (more needs a cluster: "
                                                  "kube or slurm; to make a cluster the "
                                                  "notebooks' default, write a profile once: "
                                                  f"{PROFILE_HOW})")
    experts, topk = p.get("num_experts"), p.get("num_topk")
    if experts is not None and topk is not None and topk > experts:
        raise ParameterError("num_topk", topk, f"an integer from 1 to num_experts ({experts})")
    if one_machine and p.get("ranks") is not None and p["ranks"] < 2:
        raise ParameterError("ranks", p["ranks"], "an integer >= 2 on the local context (one "
                                                  "machine: the all-to-all needs two ranks)")
    ranks = p.get("ranks") if one_machine else _world(p)
    if experts is not None and ranks and experts % ranks:
        raise ParameterError("num_experts", experts,
                             f"a multiple of the ranks ({ranks}) so every rank holds whole experts")
    _check_model_divides(p)
    _check_engine(p)
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
        if (one_machine and p.get("engine") != "transformers"
                and backend.startswith("deepep")):
            for name, allowed in deepep_needs:
                if not p.get(name):
                    raise ParameterError(name, p.get(name), allowed.format(backend=backend))
    if p.get("ab_backends") and p.get("engine") == "transformers":
        raise ParameterError("ab_backends", p["ab_backends"],
                             "'' with engine 'transformers' (it has no all-to-all backend)")
    _check_training(p, ranks)
    _check_transport(p, one_machine)
    corpus = p.get("prompt_corpus")
    if corpus not in (None, sweep.DEFAULT_PROMPT_CORPUS) and "context" in p and not one_machine:
        raise ParameterError("prompt_corpus", corpus,
                             f"{sweep.DEFAULT_PROMPT_CORPUS} on a cluster place: its AIPerf is "
                             f"the image's {_AIPERF_IMAGE} (pin aiperf_public), which has no "
                             "--prompt-corpus; coding and random need the local sweep tool's "
                             f"{_AIPERF_LOCAL} (pin aiperf_local)")
    check_places(p)
    a, b = p.get("arm_a_comms"), p.get("arm_b_comms")
    if a is not None and a == b:
        raise ParameterError("arm_b_comms", b, f"a value different from arm_a_comms ({a})")


def _check_transport(p: dict[str, Any], one_machine: bool) -> None:
    """The transport a place can carry: one machine has NVLink and no EFA; a cluster's nodes
    talk over EFA; GIN type 5 needs a pin set at or above its floor (rules_engines)."""
    name = p.get("transport")
    if name is None:
        return  # a stage without transport (03 has both it and transport_ab)
    if one_machine and name != "intranode_nvlink":
        raise ParameterError("transport", name, "intranode_nvlink on the local context (one "
                                                "machine's NVLink, GIN off); efa and "
                                                "gin_type5 cross nodes over EFA: a cluster "
                                                "(kube, slurm, or plan for one)")
    if not one_machine and "context" in p and not transport_mod.over_efa(name):
        raise ParameterError("transport", name, "efa or gin_type5 on a cluster place (its "
                                                "nodes talk over EFA)")
    if p.get("pin_set"):
        _check_floor("transport", name, p["pin_set"])
    if p.get("transport_ab"):  # both EFA contracts: GIN type 5's floor applies whichever is asked
        if one_machine:
            raise ParameterError("transport_ab", True, "false on the local context (one "
                                                      "machine has no EFA to A/B): the A/B of GIN "
                                                      "type 2 and 5 runs on a cluster place")
        _check_floor("transport_ab", "gin_type5", p["pin_set"])


def _check_floor(param: str, name: str, pin_set: str) -> None:
    """Refuse contract `name` on `pin_set` below its floor, naming the sets that reach it."""
    reaching = [s for s in pins_mod.set_names(_PINS)
                if not transport_mod.floor_problems(name, pins_mod.set_pins(_PINS, s))]
    check_pin_set(name, pin_set, pins_mod.set_pins(_PINS, pin_set), reaching, param=param)


def _check_training(p: dict[str, Any], ranks: int | None) -> None:
    """07's shape: whole experts per rank, top-k within them, whole heads, and a dispatcher the
    pinned megatron-core has."""
    experts, topk = p.get("train_experts"), p.get("train_topk")
    if experts is None:
        return
    if topk is not None and topk > experts:
        raise ParameterError("train_topk", topk, f"an integer from 1 to train_experts ({experts})")
    if ranks and experts % ranks:
        raise ParameterError("train_experts", experts, f"a multiple of the ranks ({ranks}: EP "
                                                       "spans every rank) so each holds whole "
                                                       "experts")
    hidden, heads = p.get("train_hidden"), p.get("train_heads")
    if hidden is not None and heads and hidden % heads:
        raise ParameterError("train_hidden", hidden, f"a multiple of train_heads ({heads})")
    if p.get("train_dispatcher") == "flex" and p.get("pin_set"):
        why = megatron.flex_refusal(megatron.pinned_version(p["pin_set"]))
        if why:
            raise ParameterError("train_dispatcher", "flex", f"alltoall or allgather: {why}")


def _check_engine(p: dict[str, Any]) -> None:
    """An engine named is one the pin set pins, with a backend it has (engine '' is the
    place's default, asked when the stage opens)."""
    name = p.get("engine")
    if not name:
        return
    engine = catalog.engine(name)
    chosen = p.get("pin_set")
    if engine.pin and chosen and engine.pin not in pins_mod.set_pins(_PINS, chosen):
        pinning = ", ".join(_sets_pinning(engine.pin)) or "none does yet"
        raise ParameterError("pin_set", chosen, f"a pin set that pins {name} ({pinning}): "
                                                f"set {chosen} holds no pin '{engine.pin}'")
    if not engine.expert_parallel:
        return
    for param, backends in (("all2all_backend", [p.get("all2all_backend")]),
                            ("ab_backends", p.get("ab_backends") or [])):
        for backend in backends:
            if backend and backend not in engine.backends:
                raise ParameterError(param, backend, f"{', '.join(engine.backends)} with "
                                                     f"engine {name}")


def _check_model_divides(p: dict[str, Any]) -> None:
    """Expert parallelism needs the model's routed experts divisible by the EP size (nodes x
    GPUs per node on a cluster): `-p nodes 3` with the default model is refused here."""
    model = p.get("model")
    if (not model or not p.get("nodes") or not p.get("gpus_per_node")
            or "context" in p and places.on_one_machine(place_spec_of(p))):
        return
    check_ep_divides(model, p["nodes"], p["gpus_per_node"])


def _world(p: dict[str, Any]) -> int | None:
    """The ranks of a cluster job: nodes x processes per node (`ranks`, else its GPUs)."""
    per_node = p.get("ranks") or p.get("gpus_per_node")
    if p.get("nodes") and per_node:
        return p["nodes"] * per_node
    return None


# ---- the bounds table ----------------------------------------------------------------------------
def parameter_bounds_table() -> list[dict[str, str]]:
    """One row per parameter, in the table's order, for the book and the README: the stages
    that take it (by number), its type, what it allows (the words its refusal says) and its
    default per context ("at run time": the stage decides, as its help says)."""
    rows = []
    for param in _PARAMS:
        stages = [name[:2] for name, names in STAGE_PARAMS.items() if param.name in names]
        rows.append({"parameter": param.name,
                     "stages": "all" if len(stages) == len(STAGES) else ", ".join(stages),
                     "type": param.rule.kind, "allowed": param.allowed,
                     "default": defaults_said(param)})
    return rows


def defaults_said(param: Param) -> str:
    """A parameter's default per context, as the parameters cell, papermill's help and the book
    say it: 'local: 1; plan, kube, slurm: 2', then an engine's own ('with engine sglang: ...')."""
    by_value: dict[str, list[str]] = {}
    for context in CONTEXTS:
        value = param.defaults.get(context, param.defaults.get("*"))
        by_value.setdefault(_said(value), []).append(context)
    if len(by_value) == 1:
        said = [next(iter(by_value))]
    else:
        said = [f"{', '.join(contexts)}: {value}" for value, contexts in by_value.items()]
    for key, value in param.defaults.items():
        if ":" in key:
            context, engine = key.split(":", 1)
            where = "" if context == "*" else f"{context} "
            said.append(f"{where}with engine {engine}: {_said(value)}")
    if param.name == "context":
        said = [f"{said[0]}, or the cluster profile's (python -m lib.runner profile)"]
    return "; ".join(said)


def _said(value: Any) -> str:
    if value is None:
        return "at run time"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value)) or "''"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "''" if value == "" else str(value)


def serving(stage: str, engine: str) -> bool:
    """Whether `stage` serves with these resolved values: 06 measures a serving A/B when the
    engine is vLLM (and always on a cluster place, whose engine is vLLM)."""
    return engine == "vllm"


def upstream(stage: str, engine: str = "") -> tuple[str, ...]:
    """The stages whose evidence `stage` reads (a FAIL there blocks it)."""
    return SPECS[stage].upstream(serving(stage, engine))


# ---- the typed model of each stage ----------------------------------------------------------------
# One frozen pydantic model per stage (lib.core.param_model): a field per parameter it takes
# (type, help, defaults per context, its rule as the validator) and the rules across parameters
# (_check_together) as its one validator on the whole. `resolve` builds it once.
MODELS: dict[str, type[StageParameters]] = {
    name: param_model.model_for(name, tuple(PARAMS[n] for n in names), _check_together)
    for name, names in STAGE_PARAMS.items()}
