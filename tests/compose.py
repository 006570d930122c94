"""Cluster logs no recording has, composed at test time from the recorded real logs and the line
formats ANCHORS.md cites (each format's source is quoted where it is written).

Nothing here is a recording: every file a composer writes has a name starting ``composed-``, and
it is written into the folder the test gives (never into the repository). Each composer returns
the path it wrote; a composer of a multi-node run writes one file per node (or pod), the way the
logs come back, and returns their paths in node order.

The recordings composed from (../shared/fixtures, found as REPO_ROOT.parent/"shared"/"fixtures"):
- deepep-test_ep-2xh200/test_ep_128tok_h7168_top8_e256.log: DeepEP V2's tests/elastic/test_ep.py
  on one node of 2 H200 (its Config block, its "Testing with" line, its per-rank phase lines);
- vllm-0.24.0-2xh200/vllm-deepep_v2-run2.log: vLLM 0.24.0 serving deepep_v2 at DP2 on 2 H200;
- aiperf-0.13/sweep-c1-c2-c4/concurrency_1: one AIPerf 0.13 cell's export folder.

What a composed log cannot be (see also each composer's docstring): its timings, sizes and
times are the 2-GPU recording's, repeated and renumbered, not a cross-node measurement; the
interleaving of many processes' lines is not reproduced (each process's lines come in order,
one process after another); the host names, pids, PCI bus ids of GPUs, IP addresses and the
NCCL communicator ids are invented (192.0.2.0/24 is the documentation range).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from lib.core.door import REPO_ROOT
from lib.places.stream import pack

FIXTURES = REPO_ROOT.parent / "shared" / "fixtures"
TEST_EP_LOGS = FIXTURES / "deepep-test_ep-2xh200"
TEST_EP_RECORDED = "test_ep_128tok_h7168_top8_e256.log"
VLLM_LOGS = FIXTURES / "vllm-0.24.0-2xh200"
VLLM_RECORDED = "vllm-deepep_v2-run2.log"
AIPERF_SWEEP = FIXTURES / "aiperf-0.13" / "sweep-c1-c2-c4"

PREFIX = "composed-"
HOSTS = ("composed-node-0", "composed-node-1")
NODE_IPS = ("192.0.2.2", "192.0.2.3")  # node 0's is the recording's own mq_connect_ip
DP_RPC_PORT = 29570                     # ANCHORS 1.4 (R's README)


# --- files -------------------------------------------------------------------------------------
def read_raw(path: Path) -> str:
    """A recorded log's text as written: carriage returns kept (vLLM's banner lines end in CR LF,
    a progress bar's frames start with CR), so `grep -n`'s line numbers hold."""
    path = Path(path)
    assert path.is_file(), f"fixture missing: {path} (the shared fixtures are at {FIXTURES})"
    return path.read_bytes().decode("utf-8")


def _write(dest: Path, name: str, text: str) -> Path:
    assert name.startswith(PREFIX), name
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / name
    path.write_bytes(text.encode("utf-8"))
    return path


def _lines(text: str) -> list[str]:
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


# --- NCCL and aws-ofi-nccl lines ----------------------------------------------------------------
# NCCL's prefix (NVIDIA/nccl src/debug.cc, as lib.engines.vllm_logs cites it): "%s:%d:%d " (host,
# pid, tid) then "[%d] NCCL INFO " (cudaDev); no timestamp unless NCCL_DEBUG_TIMESTAMP_FORMAT.
# The communicator line (NCCL v2.30.4-1 src/init.cc, as lib.engines.vllm_logs quotes it):
#   "%s comm %p rank %d nranks %d cudaDev %d nvmlDev %d busId %lx commId 0x%llx - Init COMPLETE"
# The plugin's provider line, in the two forms ANCHORS section 6 gives:
#   "1.21": "NET/OFI Selected provider is efa, fabric is efa-direct (found 16 nics)" (R, with
#           aws-ofi-nccl 1.21, 2026-07; the format is aws-ofi-nccl's "Selected provider is %s,
#           fabric is %s (found %d nics)");
#   "1.9":  "NET/OFI Selected Provider is efa (found 16 nics)" followed by one "NET/OFI NIC group
#           N device #M <pci>" line per NIC (NVIDIA/nccl issue #1597, p5en 8x H200, 2025);
# and with both, "Using network Libfabric" (NVIDIA/nccl issue #1597).
PROVIDER_FORMS = ("1.21", "1.9")
# p5en's 16 EFA NICs as 8 groups of 2. Groups 0, 1, 2, 7 and group 3's device #0 are the PCI
# addresses NVIDIA/nccl issue #1597's log prints; the rest are not in the quoted excerpt and are
# composed in the same pattern.
NIC_GROUPS = (("0000:56:00.0", "0000:55:00.0"), ("0000:58:00.0", "0000:57:00.0"),
              ("0000:6f:00.0", "0000:6e:00.0"), ("0000:71:00.0", "0000:70:00.0"),
              ("0000:86:00.0", "0000:85:00.0"), ("0000:88:00.0", "0000:87:00.0"),
              ("0000:a1:00.0", "0000:a0:00.0"), ("0000:a3:00.0", "0000:a2:00.0"))
# GPU bus ids (NCCL's busId, "%lx"): composed, one per local rank.
GPU_BUS_IDS = ("53000", "64000", "75000", "86000", "97000", "a8000", "b9000", "ca000")
COMM_ID = 0x5d1c0f3e9a7b2468  # composed: one communicator, shared by every rank


# NCCL 2.30.x's GIN assignment line, as a public p5en log quotes it at 2.30.7 ("GIN/Plugin:
# Assigned plugin Libfabric_GDAKI type 5 to comm"; lib.engines.nccl_logs cites it). The type-2
# plugin's name is composed (no public log here prints it); the type on the line is NCCL's.
GIN_PLUGIN_OF_TYPE = {5: "Libfabric_GDAKI", 2: "Libfabric"}


def nccl_block(host: str, pid: int, local: int, rank: int, world: int, *,
               provider_form: str = "1.21", provider: bool = True, network: str = "Libfabric",
               gin_type: int | None = None) -> list[str]:
    """One rank's NCCL lines: the plugin's provider (or none, `provider=False`: the variant of a
    rank whose provider line is missing), the network ("Socket": NCCL's silent fallback when the
    plugin did not load), and its communicator's init, with the GIN plugin NCCL assigned it
    where ``gin_type`` is given."""
    if provider_form not in PROVIDER_FORMS:
        raise ValueError(f"provider_form {provider_form!r}: one of {PROVIDER_FORMS}")
    tid = pid + 11
    p = f"{host}:{pid}:{tid} [{local}] NCCL INFO "
    out = []
    if provider:
        if provider_form == "1.21":
            out.append(p + "NET/OFI Selected provider is efa, fabric is efa-direct (found 16 nics)")
        else:
            out.append(p + "NET/OFI Selected Provider is efa (found 16 nics)")
            out += [p + f"NET/OFI NIC group {g} device #{d} {pci}"
                    for g, pair in enumerate(NIC_GROUPS) for d, pci in enumerate(pair)]
    out.append(p + f"Using network {network}")
    comm = 0x55d3a0000000 + pid * 0x100
    head = (f"ncclCommInitRankConfig comm 0x{comm:x} rank {rank} nranks {world} cudaDev {local} "
            f"nvmlDev {local} busId {GPU_BUS_IDS[local % len(GPU_BUS_IDS)]} "
            f"commId 0x{COMM_ID:x}")
    out.append(p + head + " - Init START")
    if gin_type is not None:
        out.append(p + f"GIN/Plugin: Assigned plugin {GIN_PLUGIN_OF_TYPE[gin_type]} type "
                   f"{gin_type} to comm")
    out.append(p + head + " - Init COMPLETE")
    return out


# --- test_ep across nodes -----------------------------------------------------------------------
# test_ep.py's own lines (deepseek-ai/DeepEP tests/elastic/test_ep.py): dist_print(...,
# once_in_node=True) prints the Config block and the "Testing with" line once per node; each rank
# prints "   * EP: {rank_idx:3}/{num_ranks} | dispatch: ..." and the four other phase lines; the
# Config's "Ranks: {num_scaleout_ranks} x {num_scaleup_ranks}" and "Tokens: {max(1, num_tokens -
# rank)} (max: {num_tokens})" are printed by each node's first rank.
_PHASE_RE = re.compile(r"^(\s*)([*\-#@+]) EP:\s*(\d+)/(\d+) \|(.*)$")
_RANKS_RE = re.compile(r"^( > Ranks: )\d+ x \d+")
_TOKENS_RE = re.compile(r"^( > Tokens: )(\d+)( \(max: )(\d+)(\).*)$")


def _recorded_test_ep(recorded: str) -> dict[str, Any]:
    lines = _lines(read_raw(TEST_EP_LOGS / recorded))
    head, phases, order = [], {}, []
    for line in lines:
        m = _PHASE_RE.match(line)
        if m:
            marker, rank = m.group(2), int(m.group(3))
            if marker not in order:
                order.append(marker)
            phases[(marker, rank)] = (m.group(1), m.group(5))
        elif not order:
            head.append(line)
    recorded_ranks = 1 + max(r for _, r in phases)
    return {"head": head, "phases": phases, "order": order, "ranks": recorded_ranks}


def _test_ep_node_head(rec: dict, node: int, nodes: int, per_node: int) -> list[str]:
    out = []
    first = node * per_node
    for line in rec["head"]:
        if line.startswith("NCCL version") and node != 0:
            continue  # NCCL prints its version on the communicator's rank 0 only
        if m := _RANKS_RE.match(line):
            line = f"{m.group(1)}{nodes} x {per_node}" + line[m.end():]
        elif m := _TOKENS_RE.match(line):
            tokens = int(m.group(4))
            line = f"{m.group(1)}{max(1, tokens - first)}{m.group(3)}{tokens}{m.group(5)}"
        out.append(line)
    while out and not out[-1].strip():
        out.pop()
    return out


def _phase_lines(rec: dict, markers: Sequence[str], ranks: Sequence[int], world: int) -> list[str]:
    out = []
    for marker in markers:
        for g in ranks:
            indent, rest = rec["phases"][(marker, g % rec["ranks"])]
            out.append(f"{indent}{marker} EP: {g:3}/{world} |{rest}")
    return out


def _pid(node: int, local: int) -> int:
    return 4100 + 1000 * node + local


def compose_test_ep(dest: Path, *, nodes: int = 2, ranks_per_node: int = 8,
                    provider_form: str = "1.21", drop_provider_rank: int | None = None,
                    recorded: str = TEST_EP_RECORDED, gin_type: int | None = None,
                    gin_type_of_rank: Mapping[int, int] | None = None,
                    network_of_rank: Mapping[int, str] | None = None) -> list[Path]:
    """(a) test_ep on ``nodes`` x ``ranks_per_node`` ranks over EFA, one log per node: NCCL's
    provider, network and init lines on every rank, then test_ep's output renumbered from the
    2-rank recording. (b) with ``drop_provider_rank``: that rank prints no provider line.
    ``gin_type``: every rank's GIN assignment line says that type (``gin_type_of_rank``: these
    ranks' another); ``network_of_rank``: these ranks used another network ("Socket").

    Not faithful: the timings are the 2-GPU NVLink recording's (rank r prints recorded rank
    r mod 2's numbers; "SO" stays 0 GB/s, as on one node), not a cross-node measurement."""
    rec = _recorded_test_ep(recorded)
    world = nodes * ranks_per_node
    tag = "" if drop_provider_rank is None else f"-no-provider-rank{drop_provider_rank}"
    paths = []
    for node in range(nodes):
        ranks = [node * ranks_per_node + d for d in range(ranks_per_node)]
        out = []
        host = HOSTS[node] if node < len(HOSTS) else f"composed-node-{node}"
        for d, g in enumerate(ranks):
            out += nccl_block(host, _pid(node, d), d, g, world, provider_form=provider_form,
                              provider=g != drop_provider_rank,
                              network=(network_of_rank or {}).get(g, "Libfabric"),
                              gin_type=(gin_type_of_rank or {}).get(g, gin_type))
        out += _test_ep_node_head(rec, node, nodes, ranks_per_node)
        out += _phase_lines(rec, rec["order"], ranks, world)
        out += ["", ""]
        paths.append(_write(dest, f"{PREFIX}test_ep-{world}ranks-efa{tag}-node{node}.log",
                            "\n".join(out) + "\n"))
    return paths


# The failure (c). DeepEP V2's device printf before it traps (deepseek-ai/DeepEP
# deep_ep/include/deep_ep/common/comm.cuh, gin_barrier_wo_local_sync):
#   "DeepEP Gin barrier timeout, tag: %d, scaleout: %d, scaleup: %d, thread: %d, signal: %lu,
#    target: %lu\n" with the printing rank's own scaleout and scaleup indices; tag 8 is
#   kHybridCombineTag0 there, the tag R reports ("Gin barrier timeout tag:8").
# The trap surfaces on the host as CUDA error 719, "unspecified launch failure" (the code R
# reports for the combine). PyTorch prefixes a distributed process's uncaught traceback with
# "[rankN]: " (recorded: "[rank1]:[W1130 23:01:26.985277033 CUDAGuardImpl.h:126] ..." in
# results/gpu-2xh200-deepep-vllm-20261130d/06_multicomm/vllm-graphs-ep-1.log), and torch 2.11
# raises torch.AcceleratorError with the four follow-up lines recorded there. torchrun's lines
# (bytedance/flux issue #11 and public ChildFailedError summaries): "E0628 20:25:08.343000
# <tid> torch/distributed/elastic/multiprocessing/api.py:826] failed (exitcode: 1) local_rank: 0
# (pid: N) of binary: ..." and the "Failures: / Root Cause (first observed failure):" block.
_CUDA_FOLLOW = (
    "Search for `{code}' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html"
    " for more information.",
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.",
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
)
# test_ep.py and the DeepEP frames are composed (paths of R's layout; line numbers invented).
_FRAMES = (
    '  File "/opt/DeepEP/tests/elastic/test_ep.py", line 560, in test_loop',
    "    test_dispatch_combine(buffer, args)",
    '  File "/opt/DeepEP/tests/elastic/test_ep.py", line 318, in test_dispatch_combine',
    "    t, copy_t = bench_kineto(lambda: buffer.combine(**combine_args),",
    '  File "/opt/DeepEP/deep_ep/utils/testing.py", line 141, in bench_kineto',
    "    torch.cuda.synchronize()",
)
ILLEGAL = ("CUDA error: an illegal memory access was encountered", "cudaErrorIllegalAddress")
TRAPPED = ("CUDA error: unspecified launch failure", "cudaErrorLaunchFailure")


def _rank_traceback(rank: int, error: tuple[str, str]) -> list[str]:
    body = ["Traceback (most recent call last):", *_FRAMES, f"torch.AcceleratorError: {error[0]}",
            _CUDA_FOLLOW[0].format(code=error[1]), *_CUDA_FOLLOW[1:], ""]
    return [f"[rank{rank}]: {line}".rstrip() for line in body]


def _elastic_summary(script: str, host: str, failures: list[tuple], root: tuple) -> list[str]:
    """torchrun's ChildFailedError block; each failure (time, rank, local, exitcode, pid)."""
    def entry(i, f):
        time, rank, local, code, pid = f
        trace = (f"Signal 15 (SIGTERM) received by PID {pid}" if code == -15 else
                 "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")
        return [f"[{i}]:", f"  time      : {time}", f"  host      : {host}",
                f"  rank      : {rank} (local_rank: {local})", f"  exitcode  : {code} (pid: {pid})",
                "  error_file: <N/A>", f"  traceback : {trace}"]
    out = ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "=" * 60,
           f"{script} FAILED", "-" * 60, "Failures:"]
    if failures:
        for i, f in enumerate(failures, 1):
            out += entry(i, f)
    else:
        out.append("  <NO_OTHER_FAILURES>")
    out += ["-" * 60, "Root Cause (first observed failure):", *entry(0, root), "=" * 60]
    return out


def compose_test_ep_failure(dest: Path, *, dead_rank: int = 11, nodes: int = 2,
                            ranks_per_node: int = 8, siblings: str = "timeout",
                            recorded: str = TEST_EP_RECORDED) -> list[Path]:
    """(c) test_ep where ``dead_rank`` dies first, one log per node.

    The dead rank raises an illegal memory access in the combine benchmark (after every rank
    printed its three dispatch lines). ``siblings``:
    - "timeout" (the anchors' account: "one rank died ... the other 15 are waiting"): the dead
      rank's process lingers after its error (its launcher stops nobody), so every other rank
      waits in the hybrid-combine barrier until DeepEP's GPU timeout: one "Gin barrier timeout"
      printf each, then the trap's CUDA error 719, then exit 1; torchrun's summaries come last
      (and each node's "Root Cause" is its own first exit, not the job's first failure);
    - "terminated": the dead rank exits at once, torchrun stops its node-mates (SIGTERM,
      exitcode -15) and only the other node's ranks time out.

    Not faithful: the frames' line numbers are invented, and the barrier printf of the dead
    rank's node-mates is the Gin (scaleout) one for all of them (a node-mate may wait in the
    NVLink barrier instead, "DeepEP NVLink barrier timeout, tag: ..., nvl: ...")."""
    if siblings not in ("timeout", "terminated"):
        raise ValueError(f"siblings {siblings!r}: 'timeout' or 'terminated'")
    rec = _recorded_test_ep(recorded)
    world = nodes * ranks_per_node
    dead_node, dead_local = divmod(dead_rank, ranks_per_node)
    dispatch_markers = [m for m in rec["order"] if m in "*-#"]
    paths = []
    for node in range(nodes):
        host = HOSTS[node] if node < len(HOSTS) else f"composed-node-{node}"
        ranks = [node * ranks_per_node + d for d in range(ranks_per_node)]
        out = []
        for d, g in enumerate(ranks):
            out += nccl_block(host, _pid(node, d), d, g, world)
        out += _test_ep_node_head(rec, node, nodes, ranks_per_node)
        out += _phase_lines(rec, dispatch_markers, ranks, world)
        if node == dead_node:
            out += _rank_traceback(dead_rank, ILLEGAL)
        stopped = siblings == "terminated" and node == dead_node
        waiting = [g for g in ranks if g != dead_rank and not stopped]
        for g in waiting:
            scaleout, scaleup = divmod(g, ranks_per_node)
            out.append(f"DeepEP Gin barrier timeout, tag: 8, scaleout: {scaleout}, scaleup: "
                       f"{scaleup}, thread: {dead_node if node != dead_node else 0}, "
                       f"signal: 41, target: 42")
        for g in waiting:
            out += _rank_traceback(g, TRAPPED)
        # torchrun on this node: the agent's first failure line, then its summary
        script = "/opt/DeepEP/tests/elastic/test_ep.py"
        agent = 4000 + 1000 * node
        t_dead, t_timeout = "2026-11-30_10:00:02", "2026-11-30_10:01:43"
        if node == dead_node and siblings == "terminated":
            out += [f"W1130 10:00:02.612000 {agent} torch/distributed/elastic/multiprocessing/"
                    f"api.py:897] Sending process {_pid(node, d)} closing signal SIGTERM"
                    for d in range(ranks_per_node) if d != dead_local]
            out.append(f"E1130 10:00:03.102000 {agent} torch/distributed/elastic/multiprocessing/"
                       f"api.py:869] failed (exitcode: 1) local_rank: {dead_local} (pid: "
                       f"{_pid(node, dead_local)}) of binary: /usr/bin/python3")
            failures = [(t_dead, g, g % ranks_per_node, -15, _pid(node, g % ranks_per_node))
                        for g in ranks if g != dead_rank]
            root = (t_dead, dead_rank, dead_local, 1, _pid(node, dead_local))
        else:
            first_local = 0 if node != dead_node else (1 if dead_local == 0 else 0)
            out.append(f"E1130 10:01:43.377000 {agent} torch/distributed/elastic/multiprocessing/"
                       f"api.py:869] failed (exitcode: 1) local_rank: {first_local} (pid: "
                       f"{_pid(node, first_local)}) of binary: /usr/bin/python3")
            failures = [(t_timeout, g, g % ranks_per_node, 1 if g != dead_rank else -15,
                         _pid(node, g % ranks_per_node))
                        for g in ranks if g % ranks_per_node != first_local]
            root = (t_timeout, ranks[first_local], first_local, 1, _pid(node, first_local))
        out += _elastic_summary(script, host, failures, root)
        name = f"{PREFIX}test_ep-{world}ranks-rank{dead_rank}-dies-{siblings}-node{node}.log"
        paths.append(_write(dest, name, "\n".join(out) + "\n"))
    return paths


# --- vLLM DP16 over two pods --------------------------------------------------------------------
# From the recorded 2-GPU log (vLLM 0.24.0, deepep_v2, DP2): who logs what is vllm_logs' account
# (rank 0 only: the manager, the EP split, the prepare/finalize, "rank 0 in world size N is
# assigned as DP rank 0"; every worker: "world_size=N rank=R local_rank=L ... backend=nccl";
# every engine core: "DP group leader: ...", the KV cache lines; every API server: its config,
# its routes, "Application startup complete."). The roles (ANCHORS 1.4): the leader runs
# `--data-parallel-start-rank 0 --port 8000`, the worker `--headless --data-parallel-start-rank 8`.
# API servers: vLLM's serve command (vllm/entrypoints/cli/serve.py, read at a stored commit later
# than v0.24.0) sets api_server_count to 0 with --headless, and, when --data-parallel-start-rank
# is given and --api-server-count is not, defaults it to --data-parallel-size-local with the line
# "Defaulting api_server_count to data_parallel_size_local (%d) for hybrid LB mode." (the DP2
# recording's "Defaulting api_server_count to data_parallel_size (2)." is the branch without a
# start rank). A headless node logs "Launching %d data parallel engine(s) in headless mode, with
# head node address %s." (run_headless, same source). The "[serve.py:N]" tags of these two lines
# are the recording's serve.py tag, not checked against v0.24.0.
_VPROC_RE = re.compile(r"^\((\w+) pid=(\d+)\) ")
_ACCESS_RE = re.compile(r'"(?:GET|POST|HEAD|PUT|DELETE) \S+ HTTP/1\.1" \d{3}')
_WORLD_LINE_RE = re.compile(r"world_size=(\d+) rank=(\d+) local_rank=(\d+) "
                            r"distributed_init_method=tcp://[\d.]+:(\d+)")
_EXPERTS_RE = re.compile(r"\[EP Rank 0/\d+\](.*?)Local/global number of experts: \d+/\d+\. "
                         r"Experts local to global index map: [\d\->, ]+\.")
_ARGS_RE = re.compile(r"non-default args: \{.*\}")
BACKEND_CLASSES = {  # vLLM's class names per backend (lib.engines.vllm_logs MANAGER/PREPARE_...)
    "deepep_v2": ("DeepEPV2All2AllManager", "DeepEPV2PrepareAndFinalize"),
    "allgather_reducescatter": ("AgRsAll2AllManager", "MoEPrepareAndFinalizeNaiveDPEPModular"),
    "deepep_high_throughput": ("DeepEPHTAll2AllManager", "DeepEPHTPrepareAndFinalize"),
    "deepep_low_latency": ("DeepEPLLAll2AllManager", "DeepEPLLPrepareAndFinalize"),
}
# The .pth hook R served with (bench/vllm/ep_patch_sitecustomize.py) prints this, then
# os._exit(3), when anything constructs DeepEP's legacy deep_ep.Buffer.
# patches/0002-vllm-deepep-v2-elastic-buffer-timeouts.patch's print, once per rank
TIMEOUTS_LINE = ("[guide-0002] DeepEPV2All2AllManager rank {rank}/{world}: ElasticBuffer "
                 "num_gpu_timeout_secs={gpu} num_cpu_timeout_secs={cpu} "
                 "allow_hybrid_mode={hybrid}")
SITECUSTOMIZE_LEGACY_LINE = "[t3-patch] FATAL: legacy deep_ep.Buffer constructed on EFA"
# vLLM 0.24.0's engine core when its worker process dies (recorded, vllm-graphs-ep-1.log):
DIED_LINE = ("ERROR {ts} [multiproc_executor.py:284] Worker proc VllmWorker-0 died unexpectedly, "
             "shutting down executor.")


def _owner_lines(text: str) -> list[tuple[tuple, str]]:
    """The recording's lines with their writer: ("main",), ("api", k), ("core", dp),
    ("worker", rank). Interleaved writers ("(A) (B) text" then a line with no prefix) are
    split back into one line each."""
    raw = _lines(text)
    pid_rank = {}
    for line in raw:
        m = re.match(r"^\(Worker pid=(\d+)\) .*" + _WORLD_LINE_RE.pattern, line)
        if m:
            pid_rank[m.group(1)] = int(m.group(3))
    out, i = [], 0
    while i < len(raw):
        line, prefixes = raw[i], []
        while m := _VPROC_RE.match(line):
            prefixes.append((m.group(1), m.group(2)))
            line = line[m.end():]
        if len(prefixes) >= 2 and i + 1 < len(raw) and not _VPROC_RE.match(raw[i + 1]):
            out.append((prefixes[-1], line))
            out.append((prefixes[0], raw[i + 1]))
            i += 2
            continue
        out.append((prefixes[-1] if prefixes else None, line))
        i += 1
    owned = []
    for prefix, line in out:
        if prefix is None:
            owned.append((("main",), line))
            continue
        name, pid = prefix
        if m := re.match(r"ApiServer_(\d+)$", name):
            owned.append((("api", int(m.group(1))), line))
        elif m := re.match(r"EngineCore_DP(\d+)$", name):
            owned.append((("core", int(m.group(1))), line))
        elif m := re.match(r"Worker_DP(\d+)_EP\d+$", name):
            owned.append((("worker", int(m.group(1)), "dp"), line))
        elif name == "Worker":
            owned.append((("worker", pid_rank[pid], "pid"), line))
        else:
            raise ValueError(f"an unknown writer in the recording: {name}")
    return owned


def _args_line(line: str, *, role: str, dp: int, dp_local: int, start: int, api_servers: int,
               backend: str, leader_ip: str) -> str:
    # serve.py sets api_server_count before vLLM logs its non-default args (the recording shows
    # 'api_server_count': 2 though no flag gave it); a single in-process server resets it to None
    args = {"model_tag": "/models/moe"}
    if api_servers != 1:
        args["api_server_count"] = api_servers
    if role == "worker":
        args["headless"] = True
    args.update({"model": "/models/moe", "max_model_len": 2048, "enforce_eager": True,
                 "served_model_name": ["moe"], "data_parallel_size": dp,
                 "data_parallel_size_local": dp_local, "data_parallel_start_rank": start,
                 "data_parallel_address": leader_ip, "data_parallel_rpc_port": DP_RPC_PORT,
                 "enable_expert_parallel": True, "all2all_backend": backend,
                 "gpu_memory_utilization": 0.25})
    if role == "leader":
        args["port"] = 8000
    return _ARGS_RE.sub(lambda _: "non-default args: " + repr(args), line)


def compose_vllm_pods(dest: Path, *, dp_size: int = 16, dp_local: int = 8,
                      num_experts: int = 128, backend: str = "deepep_v2",
                      api_server_count: int | None = None, provider_form: str = "1.21",
                      drop_provider_rank: int | None = None,
                      sitecustomize_legacy_rank: int | None = None,
                      dead_rank: int | None = None, tag: str = "",
                      elastic_timeouts: tuple[int, int] | None = (600, 600),
                      drop_timeouts_rank: int | None = None,
                      allow_hybrid_mode: bool = True) -> list[Path]:
    """(d) vLLM expert-parallel serve at DP ``dp_size`` on ``dp_size // dp_local`` pods (leader,
    then headless workers), one log per pod, renumbered from the 2-GPU deepep_v2 recording:
    "[EP Rank 0/16] ... Local/global number of experts: 8/128" and the manager on the leader,
    NCCL's provider, network and init lines on every rank (unprefixed: NCCL writes from C, past
    vLLM's prefixing, as recorded in vllm-graphs-ep-1.log), "Application startup complete." once
    per API server, on the leader only.

    Variants: ``drop_provider_rank`` (that rank prints no provider line); ``backend`` a legacy
    DeepEP one ("deepep_high_throughput": vLLM's own manager and prepare/finalize lines name
    the classes built on deep_ep.Buffer); ``sitecustomize_legacy_rank`` (R's .pth hook prints
    its FATAL line on that rank, whose process exits 3; its engine core reports the death, and
    both pods' logs end there: the leader never completes the engines' handshake);
    ``dead_rank`` (after every rank's communicator, in the first all-to-all of the engines'
    start-up, that rank's worker raises an illegal memory access, in vLLM 0.24.0's recorded
    "WorkerProc hit an exception." form (vllm-graphs-ep-1.log), and every other rank's DeepEP
    kernel prints its Gin barrier timeout (DeepEP's device printf, unprefixed as NCCL's C output
    is); no pod logs ready). ``elastic_timeouts`` (GPU, CPU seconds): each deepep_v2 rank's
    worker prints the line of this guide's vLLM patch 0002, which the image applies (Layer 7b),
    after its communicator; its format is the patch's own print (no served run has recorded it
    yet); None: an image without 0002 (no line); ``drop_timeouts_rank`` (that rank prints none);
    ``allow_hybrid_mode``: the DeepEP-V2 mode that line says each rank passed (hybrid: True).

    Not faithful: the model is the recording's tiny MoE (/models/moe) with its expert count set
    to ``num_experts``; sizes, KV cache and times are the 2-GPU recording's; API servers after
    the first repeat the first one's lines; ``api_server_count`` None is vLLM's default for
    these flags (the leader's --data-parallel-size-local), 1 a single in-process server."""
    if backend not in BACKEND_CLASSES:
        raise ValueError(f"backend {backend!r}: one of {sorted(BACKEND_CLASSES)}")
    pods = dp_size // dp_local
    local_experts = num_experts // dp_size
    owned = _owner_lines(read_raw(VLLM_LOGS / VLLM_RECORDED))
    manager_v2, pf_v2 = BACKEND_CLASSES["deepep_v2"]
    manager, pf = BACKEND_CLASSES[backend]
    n_api = dp_local if api_server_count is None else api_server_count
    leader_ip = NODE_IPS[0]
    paths = []
    for pod in range(pods):
        role = "leader" if pod == 0 else "worker"
        host, ip = HOSTS[pod] if pod < len(HOSTS) else f"composed-node-{pod}", \
            NODE_IPS[pod] if pod < len(NODE_IPS) else f"192.0.2.{2 + pod}"
        start = pod * dp_local
        ranks = list(range(start, start + dp_local))
        apis = n_api if role == "leader" else 0
        out: list[str] = []
        died = False
        api_started = False  # a single in-process server: the main process logged the config

        def core_pid(g):
            return 2900 + 10 * g

        def worker_pid(g):
            return 3300 + 10 * g

        def api_pid(k):
            return 2800 + k

        def rewrite(line: str, g: int | None = None) -> str:
            line = line.replace("data_parallel_size=2", f"data_parallel_size={dp_size}")
            line = line.replace("rank 0 in world size 2", f"rank 0 in world size {dp_size}")
            line = line.replace("E=32,N=512", f"E={local_experts},N=512")
            line = line.replace("mq_connect_ip=192.0.2.2 (local)", f"mq_connect_ip={ip} (local)")
            line = line.replace(manager_v2, manager).replace(pf_v2, pf)
            if g is not None:
                line = _WORLD_LINE_RE.sub(
                    lambda m: (f"world_size={dp_size} rank={g} local_rank={g - start} "
                               f"distributed_init_method=tcp://{leader_ip}:{m.group(4)}"), line)
                line = _EXPERTS_RE.sub(
                    lambda m: (f"[EP Rank {g}/{dp_size}]{m.group(1)}Local/global number of "
                               f"experts: {local_experts}/{num_experts}. Experts local to global "
                               "index map: " + ", ".join(f"{i}->{g * local_experts + i}"
                                                          for i in range(local_experts)) + "."),
                    line)
            return line

        for owner, line in owned:
            if died:
                break
            kind = owner[0]
            if kind == "main":
                if "Defaulting api_server_count" in line:
                    if role == "leader" and api_server_count is None and n_api > 1:
                        out.append(re.sub(r"Defaulting api_server_count to .*",
                                          "Defaulting api_server_count to "
                                          f"data_parallel_size_local ({n_api}) for hybrid LB "
                                          "mode.", line))
                    continue
                if "non-default args:" in line:
                    out.append(_args_line(line, role=role, dp=dp_size, dp_local=dp_local,
                                          start=start, api_servers=apis, backend=backend,
                                          leader_ip=leader_ip))
                    continue
                if "Started DP Coordinator process" in line:
                    if role == "worker":
                        out.append(re.sub(r"\[utils\.py:\d+\] Started DP Coordinator.*",
                                          f"[serve.py:119] Launching {dp_local} data parallel "
                                          "engine(s) in headless mode, with head node address "
                                          f"tcp://{leader_ip}:{DP_RPC_PORT}.", line))
                    else:
                        out.append(line)
                    continue
                if "Started 2 API server processes" in line:
                    if role == "leader" and apis > 1:
                        out.append(line.replace("Started 2 API", f"Started {apis} API"))
                    continue
                leader_only = ("All engine subscriptions received", "AsyncLLM created with "
                               "api_server_count", "Waiting for API servers to complete")
                if any(s in line for s in leader_only):
                    if role == "leader" and (apis > 1 or "subscriptions" in line):
                        out.append(line)
                    continue
                out.append(rewrite(line))
            elif kind == "api":
                if role != "leader":
                    continue
                k = owner[1]
                if _ACCESS_RE.search(line):
                    if k < apis:
                        out.append(line if apis == 1 else f"(ApiServer_{k} pid={api_pid(k)}) "
                                   + line)
                    continue
                if k != 0:
                    continue
                api_started = api_started or "Supported tasks" in line
                if apis == 1 and (not api_started or "api_server_count more than 1" in line):
                    continue
                for j in range(apis):
                    text = line.replace("process [2958]", f"process [{api_pid(j)}]")
                    out.append(text if apis == 1 else f"(ApiServer_{j} pid={api_pid(j)}) " + text)
            elif kind == "core":
                template = owner[1]
                for g in ranks:
                    if (g == 0) != (template == 0):
                        continue
                    out.append(f"(EngineCore_DP{g} pid={core_pid(g)}) " + rewrite(line, g))
            else:  # a worker
                template, named = owner[1], owner[2]
                for g in ranks:
                    if (g == 0) != (template == 0):
                        continue
                    who = f"Worker_DP{g}_EP{g}" if named == "dp" else "Worker"
                    out.append(f"({who} pid={worker_pid(g)}) " + rewrite(line, g))
                    if not _WORLD_LINE_RE.search(line):
                        continue
                    out += nccl_block(host, worker_pid(g), g - start, g, dp_size,
                                      provider_form=provider_form,
                                      provider=g != drop_provider_rank)
                    if backend == "deepep_v2" and elastic_timeouts and g != drop_timeouts_rank:
                        out.append(f"({who} pid={worker_pid(g)}) " + TIMEOUTS_LINE.format(
                            rank=g, world=dp_size, gpu=elastic_timeouts[0],
                            cpu=elastic_timeouts[1], hybrid=allow_hybrid_mode))
                    if sitecustomize_legacy_rank == g:
                        # the all-to-all is built right after the communicator: the hook's trap
                        out.append(f"({who} pid={worker_pid(g)}) {SITECUSTOMIZE_LEGACY_LINE}")
                        ts = re.search(r"\d\d-\d\d \d\d:\d\d:\d\d", line).group(0)
                        out.append(f"(EngineCore_DP{g} pid={core_pid(g)}) "
                                   + DIED_LINE.format(ts=ts))
                if sitecustomize_legacy_rank is not None and _WORLD_LINE_RE.search(line):
                    died = True  # both pods' logs end here: the engines never became ready
                if dead_rank is not None and _WORLD_LINE_RE.search(line):
                    ts = re.search(r"\d\d-\d\d \d\d:\d\d:\d\d", line).group(0)
                    out += _first_dispatch_death(ranks, dead_rank, dp_local, ts, worker_pid)
                    died = True
        name = (f"{PREFIX}vllm-dp{dp_size}-{backend}{tag}-"
                f"{'leader' if role == 'leader' else f'worker{pod}'}.log")
        paths.append(_write(dest, name, "\n".join(out) + "\n"))
    return paths


def _first_dispatch_death(ranks: list[int], dead_rank: int, per_node: int, ts: str,
                          worker_pid) -> list[str]:
    """A pod's ranks in the first all-to-all when `dead_rank` dies there (compose_vllm_pods'
    `dead_rank`): its worker's error and traceback as vLLM 0.24.0 logs one (recorded form; the
    frames here are DeepEP's combine), the others' DeepEP Gin barrier timeout printf (triage:
    the printing rank = scaleout x ranks per node + scaleup)."""
    out = []
    for g in ranks:
        if g == dead_rank:
            pre = (f"(Worker_DP{g}_EP{g} pid={worker_pid(g)}) ERROR {ts} "
                   "[multiproc_executor.py:1000] ")
            out += [pre + "WorkerProc hit an exception.",
                    pre + "Traceback (most recent call last):",
                    pre + '  File "/usr/local/lib/python3.12/dist-packages/deep_ep/buffers/'
                          'elastic.py", line 812, in combine',
                    pre + "torch.AcceleratorError: CUDA error: an illegal memory access was "
                          "encountered"]
    for g in ranks:
        if g != dead_rank:
            node, local = divmod(g, per_node)
            out.append(f"DeepEP Gin barrier timeout, tag: 8, scaleout: {node}, scaleup: "
                       f"{local}, thread: 0, signal: 1, target: 2")
    return out


# --- TensorRT-LLM's pods -------------------------------------------------------------------------
# The public reproduction's recorded TensorRT-LLM 0.21.0 serve: its leader's mpirun output of all
# 16 ranks (provider_evidence.log)
TRTLLM_RECORDED = (FIXTURES / "public-repro" / "results" / "trtllm-deepep-dropin-20260707"
                   / "trtllm" / "provider_evidence.log")


def compose_trtllm_pods(dest: Path) -> list[Path]:
    """TensorRT-LLM's two pods on kube: the leader's recorded log (TRTLLM_RECORDED, as it is) and
    the worker's, composed: its sshd's one line (OpenSSH's "Server listening on ..." with -e)."""
    worker = _write(dest, f"{PREFIX}trtllm-worker-sshd.log",
                    "Server listening on 0.0.0.0 port 2222.\n")
    return [TRTLLM_RECORDED, worker]


# --- node probes --------------------------------------------------------------------------------
ProbeFormatter = Callable[[Mapping[str, Any]], str]
# p5en's EFA devices as rdma-core names them ("rdmap<PCI bus, decimal>s<slot>"), from the NIC
# PCI addresses above.
P5EN_EFA_DEVICES = tuple(f"rdmap{int(pci.split(':')[1], 16)}s0"
                         for pair in NIC_GROUPS for pci in pair)


def probe_facts(node: str = HOSTS[0], *, gdrdrv_version: str | None = "2.5.1",
                efa_devices: Sequence[str] = P5EN_EFA_DEVICES, hugepages_total: int = 4096,
                hugepage_size_kib: int = 2048) -> dict[str, Any]:
    """One node's probe facts, keyed as lib.places.local's host_facts keys them. Defaults: gdrdrv
    2.5.1 (V's gdrcopy pin, ANCHORS 1.1), p5en's 16 EFA NICs, 8 GiB of 2 MiB hugepages (R's
    manifest limit, hugepages-2Mi: 8Gi)."""
    return {"node": node, "gdrdrv_version": gdrdrv_version, "efa_devices": list(efa_devices),
            "hugepages_total": hugepages_total, "hugepage_size_kib": hugepage_size_kib}


def default_probe_format(facts: Mapping[str, Any]) -> str:
    """PLACEHOLDER: ``key=value`` lines until lib/places/kube/manifests/probe.py defines the probe's own
    output format; pass its formatter to `compose_node_probe` instead. An absent gdrdrv prints
    no gdrdrv_version line (the module's /sys/module/gdrdrv/version is then absent)."""
    lines = []
    if facts.get("gdrdrv_version"):
        lines.append(f"gdrdrv_version={facts['gdrdrv_version']}")
    lines += [f"efa_device={d}" for d in facts["efa_devices"]]
    lines += [f"hugepages_total={facts['hugepages_total']}",
              f"hugepage_size_kib={facts['hugepage_size_kib']}"]
    return "\n".join(lines) + "\n"


def compose_node_probe(dest: Path, node: str = HOSTS[0], *,
                       formatter: ProbeFormatter = default_probe_format, **facts) -> Path:
    """(e) one node's probe output, in ``formatter``'s format, from `probe_facts(node, **facts)`."""
    return _write(dest, f"{PREFIX}node-probe-{node.removeprefix(PREFIX)}.txt",
                  formatter(probe_facts(node, **facts)))


# --- an AIPerf Job's log ------------------------------------------------------------------------
def compose_aiperf_job_log(dest: Path, *, cell: str = "concurrency_1", block: str = "aiperf-c1",
                           console_lines: int = 12) -> Path:
    """(f) what an AIPerf Job's pod prints: the first ``console_lines`` of AIPerf's console
    output (the cell's recorded profile_export_console.txt: AIPerf writes the same tables to the
    console), then the cell's export folder as lib.places.stream.pack prints it (block ``block``).
    Not faithful: AIPerf's progress output before the tables is not recorded, so it is left out."""
    folder = AIPERF_SWEEP / cell
    assert folder.is_dir(), f"fixture missing: {folder}"
    console = _lines(read_raw(folder / "profile_export_console.txt"))[:console_lines]
    text = "\n".join(console) + "\n" + pack(folder, block)
    return _write(dest, f"{PREFIX}aiperf-job-{cell}.log", text)


# --- SGLang across nodes ------------------------------------------------------------------------
# No SGLang log was ever recorded here or published by the public reproduction: every line is
# composed from the format strings SGLang 0.5.19's own source prints (its PyPI wheel, read here
# 2026-12-03; lib/engines/sglang.py cites each): the logger's "[%Y-%m-%d %H:%M:%S{prefix}] "
# (utils/common.py:2353-2373) with " DP{d} TP{t} EP{e}" on a scheduler (managers/scheduler.py:
# 5494-5514, DP attention on), none on the launcher; the launcher's "server_args={...}"
# (entrypoints/engine.py:1098) and its two DeepEP v2 warnings (arg_groups/moe_hook.py:229-242),
# once per node; per rank "Init torch distributed begin." (distributed/bootstrap.py:82), NCCL's
# own lines (nccl_block) and "Initialized DeepEP v2 ElasticBuffer: ..." on its first dispatch
# (layers/moe/token_dispatcher/deepep_v2.py:198-209); node rank 0's "The server is fired up and
# ready to roll!" (entrypoints/http_server.py:2412), node k's "Dummy health check server started
# in background thread at {host}:{port}" (utils/common.py:3359-3361).
SGLANG_TS = "2026-12-03 10:00:{:02d}"


def _sglang_launcher(ts: str, a2a: str, world: int, nodes: int, node: int, mode: str) -> list[str]:
    args = (f"server_args={{'model_path': 'Qwen/Qwen3-30B-A3B-FP8', 'tp_size': {world}, "
            f"'dp_size': {world}, 'ep_size': {world}, 'enable_dp_attention': True, "
            f"'moe_a2a_backend': '{a2a}', 'deepep_v2_mode': '{mode}', 'moe_runner_backend': "
            f"'{'deep_gemm' if a2a == 'deepep_v2' else 'auto'}', 'nnodes': {nodes}, "
            f"'node_rank': {node}, 'port': 8000}}")
    out = [f"[{ts}] {args}"]
    if a2a == "deepep_v2":
        out += [f"[{ts}] DeepEP v2 MoE is enabled. The expert parallel size is adjusted to be the "
                f"same as the tensor parallel size[{world}].",
                f"[{ts}] DeepEP v2 MoE is using deepep_v2_mode={mode}. This controls ElasticBuffer "
                "direct/hybrid mode and is independent from --deepep-mode normal/low_latency. "
                "DeepEP v2 MoE enables the decode CUDA graph on the masked decode path (any comm "
                "mode) and disables shared expert fusion. "
                "SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK is a per-rank communication "
                "buffer capacity, not a model limit; increase it for large prefill/chunked-prefill "
                "workloads."]
    return out


def compose_sglang_pods(dest: Path, *, world: int = 16, per_node: int = 8,
                        backend: str = "deepep_v2", mode: str | None = None,
                        drop_buffer_rank: int | None = None,
                        drop_provider_rank: int | None = None,
                        crash_rank: int | None = None, tag: str = "") -> list[Path]:
    """SGLang 0.5.19's logs of a DP-attention serve at TP = DP = EP = `world` over
    `world // per_node` nodes, one file per node (node rank 0 first), composed from its source's
    formats (see above). Variants: `drop_buffer_rank` (that rank logs no ElasticBuffer line: a
    rank that never dispatched through DeepEP); `drop_provider_rank` (no EFA provider line on
    it); `crash_rank` (its scheduler logs "Scheduler hit an exception" and node 0's launcher
    "Received sigquit from a child process"; no node logs ready); `mode` (the DeepEP v2 mode the
    launchers resolved; default hybrid across nodes). `backend` is the guide's name
    (deepep_v2, or allgather_reducescatter = SGLang's none).

    Not faithful: the order of lines across processes, the times, pids and sizes
    (num_bytes) are invented; the model's hidden size (2048) and top-k (8) are Qwen3-30B-A3B's."""
    a2a = {"deepep_v2": "deepep_v2", "allgather_reducescatter": "none"}[backend]
    nodes = world // per_node
    mode = mode or ("hybrid" if nodes > 1 else "direct")
    paths = []
    for node in range(nodes):
        host = HOSTS[node] if node < len(HOSTS) else f"composed-node-{node}"
        out = _sglang_launcher(SGLANG_TS.format(1), a2a, world, nodes, node, mode)
        for local in range(per_node):
            rank = node * per_node + local
            pre = f"[{SGLANG_TS.format(2)} DP{rank} TP{rank} EP{rank}] "
            out.append(pre + "Init torch distributed begin.")
            out += nccl_block(host, 4000 + rank, local, rank, world,
                              provider=rank != drop_provider_rank)
            out.append(f"[{SGLANG_TS.format(9)} DP{rank} TP{rank} EP{rank}] Init torch "
                       "distributed ends. elapsed=6.31 s, mem usage=0.55 GB")
            out.append(f"[{SGLANG_TS.format(10)} DP{rank} TP{rank} EP{rank}] Load weight begin. "
                       "avail mem=138.12 GB")
            if rank == crash_rank:
                out += [f"[{SGLANG_TS.format(31)} DP{rank} TP{rank} EP{rank}] Scheduler hit an "
                        "exception: Traceback (most recent call last):",
                        "RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/"
                        "ProcessGroupNCCL.cpp, remote process exited or there was a network "
                        "error"]
                continue
            if a2a == "deepep_v2" and rank != drop_buffer_rank and crash_rank is None:
                out.append(f"[{SGLANG_TS.format(40)} DP{rank} TP{rank} EP{rank}] Initialized "
                           f"DeepEP v2 ElasticBuffer: world_size={world} hidden_size=2048 "
                           f"num_topk=8 max_dispatch_tokens_per_rank=1024 use_fp8_dispatch=True "
                           f"allow_hybrid_mode={mode == 'hybrid'} num_bytes=2147483648")
        if crash_rank is not None:
            if node == 0:
                out.append(f"[{SGLANG_TS.format(32)}] Received sigquit from a child process. It "
                           "usually means the child failed.")
        elif node == 0:
            out.append(f"[{SGLANG_TS.format(45)}] The server is fired up and ready to roll!")
        else:
            out.append(f"[{SGLANG_TS.format(44)}] Dummy health check server started in background "
                       "thread at 0.0.0.0:8000")
        paths.append(_write(dest, f"{PREFIX}sglang{tag}-node{node}.log", "\n".join(out) + "\n"))
    return paths


# --- stage 07's training, two pods ---------------------------------------------------------------
# From the real rank logs tests/train_logs/record.py recorded (README.md there): lib.bench.moe_train
# prints `moe-train <kind> {json}` lines (json.dumps, sort_keys=True: a `step` line's fields in
# the order grad_norm, loss, rank, received_from_other_ranks, routed_to_other_ranks,
# sent_to_other_ranks, step, step_s). json.dumps writes a float NaN as `NaN`.
TRAIN_LOGS = REPO_ROOT / "tests" / "train_logs"
_TRAIN_STEP_RE = re.compile(r'^(moe-train step \{"grad_norm": )[^,]+(, "loss": )[^,]+'
                            r'(, "rank": \d+, .*"step": (\d+), .*)$')
_TRAIN_START_RE = re.compile(r'^(moe-train start \{.*"dispatcher": )"\w+"(, .*"dispatchers": )'
                             r'\[[^\]]*\](, .*"rank": (\d+), .*)$')


def recorded_train_pods(case: str = "pass", nodes: int = 2) -> list[Path]:
    """The recorded logs of one case, one per node (tests/train_logs/README.md)."""
    paths = [TRAIN_LOGS / f"recorded-{case}-node{k}.log" for k in range(nodes)]
    for path in paths:
        assert path.is_file(), f"recording missing: {path} (tests/train_logs/record.py)"
    return paths


def compose_train_pods(dest: Path, *, nan_from_step: int | None = None,
                       dispatcher_rank: int | None = None,
                       dispatcher: str = "MoEAllGatherTokenDispatcher") -> list[Path]:
    """The recorded `pass` logs with one thing changed, one per node:

    - nan_from_step k: from step k on, every rank's step line reads `"loss": NaN` and
      `"grad_norm": NaN` (the ranks log the loss averaged over all of them, so a NaN on one is a
      NaN on every one; the backward of a NaN loss gives NaN gradients);
    - dispatcher_rank r: rank r's start line names `dispatcher` as the class it built (in its
      `dispatcher` and `dispatchers` fields).

    Not faithful: the token counts stay the recording's (an allgather dispatcher keeps no split
    sizes, so its rank would count none sent; a rank whose loss is NaN routes NaN scores)."""
    if nan_from_step is None and dispatcher_rank is None:
        raise ValueError("compose_train_pods: give nan_from_step or dispatcher_rank")

    def changed(line: str) -> str:
        step = _TRAIN_STEP_RE.match(line)
        if step and nan_from_step is not None and int(step[4]) >= nan_from_step:
            return f"{step[1]}NaN{step[2]}NaN{step[3]}"
        start = _TRAIN_START_RE.match(line)
        if start and dispatcher_rank is not None and int(start[4]) == dispatcher_rank:
            return f'{start[1]}"{dispatcher}"{start[2]}["{dispatcher}"]{start[3]}'
        return line

    tag = (f"-nan-from-step{nan_from_step}" if nan_from_step is not None else "") + \
        (f"-rank{dispatcher_rank}-{dispatcher}" if dispatcher_rank is not None else "")
    paths = []
    for node, recorded in enumerate(recorded_train_pods()):
        text = "\n".join(changed(line) for line in _lines(read_raw(recorded))) + "\n"
        paths.append(_write(dest, f"{PREFIX}train{tag}-node{node}.log", text))
    return paths
