"""Backend assertions from vLLM's real logs, shared by the local (2-GPU) and cluster paths.

Pure functions: text in, gate dicts out ({gate, status, observed, expected, reason, evidence}).
Evidence entries are ``<log_name>:<line number>: <the line>`` so a reader finds the line.

What vLLM 0.24.0 logs, read from the real logs of two H200s
(../shared/fixtures/vllm-0.24.0-2xh200/, TOOLCHAIN.md "vLLM 0.24.0 on two H200s"):

- from global rank 0 only (``logger.info_once(..., scope="global")`` and friends): the manager,
  "(Worker pid=..) INFO .. [cuda_communicator.py:185] Using AgRsAll2AllManager all2all manager.";
  the EP split, "[EP Rank 0/2] Expert parallelism is enabled. ... Local/global number of
  experts: 32/64. ..."; the prepare/finalize class, "[unquantized.py:312] Using
  MoEPrepareAndFinalizeNaiveDPEPModular" or "Using DeepEPV2PrepareAndFinalize"; and
  "rank 0 in world size 2 is assigned as DP rank 0, ... EP rank 0". On a cluster these lines are
  in the leader's log only, and they say nothing about the other ranks: per-rank claims rest on
  per-rank sources (``per_rank_nccl``, ``efa_provider_per_rank``).
- once per API server: "(ApiServer_N pid=..) INFO:     Application startup complete." (uvicorn,
  no timestamp); ``vllm serve`` with DP > 1 defaults api_server_count to DP ("Defaulting
  api_server_count to data_parallel_size (2).").
- in every process that validates the config (main and each API server): the fallback warning
  "The 'naive' all2all backend has been removed. Falling back to 'allgather_reducescatter'."
- no NCCL INFO lines at all: those runs did not set NCCL_DEBUG. The NCCL parsers below follow
  the format NCCL itself prints (cited at each regex) and are tested on lines quoted from public
  NCCL and aws-ofi-nccl output.

Lines from several processes can interleave: "(ApiServer_0 pid=2958) (ApiServer_1 pid=2959)
WARNING ..." followed by a line with no prefix. Every pattern is searched anywhere in a line,
and counts are counts of occurrences, not of prefixes.
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from datetime import datetime

from lib.core.evidence import Gate, gate, skip

# --- what each backend should construct (vLLM 0.24.0) -----------------------------------------
# allgather_reducescatter and deepep_v2: seen in the real 0.24.0 logs above. The others: read in
# vLLM's CudaCommunicator source (vllm/distributed/device_communicators/cuda_communicator.py, the
# `if self.use_all2all:` dispatch, at a stored commit later than v0.24.0 whose branches for these
# names are unchanged since the DeepEP HT/LL managers were introduced); the v0.24.0 tag itself
# could not be fetched here, and no 0.24.0 log of them exists. They are marked so in `SOURCE`.
MANAGER = {
    "allgather_reducescatter": "AgRsAll2AllManager",
    "deepep_v2": "DeepEPV2All2AllManager",
    "deepep_high_throughput": "DeepEPHTAll2AllManager",
    "deepep_low_latency": "DeepEPLLAll2AllManager",
    "mori_high_throughput": "MoriAll2AllManager",
    "mori_low_latency": "MoriAll2AllManager",
    "nixl_ep": "NixlEPAll2AllManager",
    "flashinfer_nvlink_two_sided": "FlashInferNVLinkTwoSidedManager",
    "flashinfer_all2allv": "FlashInferNVLinkTwoSidedManager",
    "flashinfer_nvlink_one_sided": "FlashInferNVLinkOneSidedManager",
}
PREPARE_FINALIZE = {
    "allgather_reducescatter": "MoEPrepareAndFinalizeNaiveDPEPModular",
    "deepep_v2": "DeepEPV2PrepareAndFinalize",
    "deepep_high_throughput": "DeepEPHTPrepareAndFinalize",
    "deepep_low_latency": "DeepEPLLPrepareAndFinalize",
}
SEEN_IN_0_24_LOGS = ("allgather_reducescatter", "deepep_v2")
SOURCE = {b: ("seen in vLLM 0.24.0 logs on two H200s" if b in SEEN_IN_0_24_LOGS
              else "from vLLM source, not seen in a 0.24.0 log") for b in MANAGER}
# vLLM's ParallelConfig validator replaces these with allgather_reducescatter (vllm-naive.log).
REMOVED = ("naive", "pplx")
# vLLM 0.24.0's default --all2all-backend: the allgather log's "non-default args" has no
# all2all_backend key, and AgRs was built.
DEFAULT_BACKEND = "allgather_reducescatter"
# Managers / prepare-finalize classes built on DeepEP's legacy deep_ep.Buffer.
LEGACY_BUFFER_CLASSES = ("DeepEPHTAll2AllManager", "DeepEPLLAll2AllManager",
                         "DeepEPHTPrepareAndFinalize", "DeepEPLLPrepareAndFinalize")
# A legacy deep_ep.Buffer constructed in a process, as a guard prints it: R's .pth hook prints
# "[t3-patch] FATAL: legacy deep_ep.Buffer constructed on EFA" before os._exit(3) (ANCHORS 1.4).
# Logged by the process that built it, on any rank: a per-rank source.
_LEGACY_BUILT_RE = re.compile(r"\blegacy deep_ep\.Buffer\b|\bdeep_ep\.Buffer\b.*\bconstructed\b")
RANK0_ONLY = ("logged by rank 0 only (global rank 0's worker; on a cluster, the leader's log); "
              "says nothing about the other ranks")

_MANAGER_RE = re.compile(r"Using (\w+) all2all manager\.")
_FALLBACK_RE = re.compile(
    r"The '(\w+)' all2all backend has been removed\. Falling back to '(\w+)'\.")
_EP_RE = re.compile(r"\[EP Rank (\d+)/(\d+)\].*?Local/global number of experts: (\d+)/(\d+)")
_PF_RE = re.compile(r"Using (\w*PrepareAndFinalize\w*)\s*$")
_READY = "Application startup complete."
_ARGS_BACKEND_RE = re.compile(r"non-default args: \{.*?'all2all_backend': '(\w+)'")
_ARGS_RE = re.compile(r"non-default args: \{")
_RANK0_RE = re.compile(r"\(\w+ pid=(\d+)\).*?rank 0 in world size (\d+) is assigned as DP rank 0")
_PID_RE = re.compile(r"\((\w+) pid=(\d+)\)")
_NCCL_VERSION_RE = re.compile(r"vLLM is using nccl==(\S+)")
_API_STARTED_RE = re.compile(r"Started (\d+) API server processes")
# vLLM's own log prefix: "INFO 11-30 09:41:41 [serve.py:119] ..." (month-day, no year).
_TS_RE = re.compile(
    r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) \[")

# the log's lines as `grep -n` numbers them, and a quoted line: the same for every engine
from lib.engines.nccl_logs import lines_of as _lines, quote as _quote  # noqa: E402


def _find(lines: list[str], pattern: re.Pattern) -> list[tuple[int, str, re.Match]]:
    out = []
    for i, line in enumerate(lines, 1):
        m = pattern.search(line)
        if m:
            out.append((i, line, m))
    return out


def _pid_of(line: str) -> str | None:
    found = _PID_RE.findall(line)
    return found[-1][1] if found else None


def rank0_pid(log_text: str) -> str | None:
    """pid of the worker vLLM assigns global rank 0 ("rank 0 in world size N is assigned ...")."""
    for _, _, m in _find(_lines(log_text), _RANK0_RE):
        return m.group(1)
    return None


def nccl_version(log_text: str) -> str | None:
    """The NCCL vLLM's pynccl loaded ("vLLM is using nccl==2.30.4"), logged by rank 0 only."""
    for _, _, m in _find(_lines(log_text), _NCCL_VERSION_RE):
        return m.group(1)
    return None


def requested_in_log(log_text: str) -> str | None:
    """The --all2all-backend vLLM received, from its "non-default args" line.

    An absent key means the default (allgather_reducescatter); None when the line is missing.
    """
    lines = _lines(log_text)
    for _, _, m in _find(lines, _ARGS_BACKEND_RE):
        return m.group(1)
    return DEFAULT_BACKEND if _find(lines, _ARGS_RE) else None


def _gate_manager(lines, requested, log_name, r0pid) -> Gate:
    name = "vllm_all2all_manager"
    built = _find(lines, _MANAGER_RE)
    classes = sorted({m.group(1) for _, _, m in built})
    fallbacks = _find(lines, _FALLBACK_RE)
    fb_evidence = [_quote(log_name, i, l) for i, l, _ in fallbacks]
    built_evidence = [_quote(log_name, i, l) for i, l, _ in built]
    as_passed = requested_in_log("\n".join(lines))
    observed = {"constructed": classes, "requested_in_log": as_passed,
                "fallback_warnings": len(fallbacks)}
    if r0pid and built:
        observed["logged_by_pid"] = sorted({_pid_of(l) for _, l, _ in built} - {None})
        observed["rank0_pid"] = r0pid
    if requested in REMOVED or fallbacks:
        replaced = sorted({(m.group(1), m.group(2)) for _, _, m in fallbacks})
        what = "; ".join(f"{a!r} was replaced by {b!r}" for a, b in replaced) or \
            f"{requested!r} has no manager in vLLM 0.24.0"
        return gate(name, False, observed, MANAGER.get(requested, f"{requested}: removed"),
                    f"vLLM fell back instead of building the requested backend: {what} "
                    f"(constructed: {', '.join(classes) or 'none found'}). A measurement of this "
                    f"run is a measurement of the fallback, not of {requested!r}.",
                    fb_evidence + built_evidence)
    expected = MANAGER.get(requested)
    if expected is None:
        return gate(name, False, observed, f"the manager class of {requested!r}",
                    f"unknown: no manager class known for backend {requested!r} in vLLM 0.24.0 "
                    f"(known: {', '.join(sorted(MANAGER))})", built_evidence)
    if not built:
        return gate(name, False, observed, expected,
                    f"no 'Using <X> all2all manager.' line; it is {RANK0_ONLY}. Is this the "
                    "leader's log (or the local one), written with vLLM's INFO level?", [])
    problems = []
    if classes != [expected]:
        problems.append(f"requested {requested!r} (manager {expected}) but vLLM built "
                        f"{', '.join(classes)}")
    if as_passed is not None and as_passed != requested:
        problems.append(f"the log's non-default args show all2all_backend {as_passed!r}, not "
                        f"{requested!r}: this log is not from a run that asked for {requested!r}")
    if problems:
        return gate(name, False, observed, expected, "; ".join(problems) + f" ({RANK0_ONLY})",
                    built_evidence)
    return gate(name, True, observed, expected,
                f"vLLM built {expected}; {RANK0_ONLY}; mapping {requested} -> {expected} "
                f"{SOURCE[requested]}", built_evidence)


def _gate_ep_split(lines, dp_size, num_experts, log_name) -> Gate:
    name = "vllm_ep_split"
    found = _find(lines, _EP_RE)
    evidence = [_quote(log_name, i, l) for i, l, _ in found]
    if num_experts is not None:
        expected = {"ep_size": dp_size, "global_experts": num_experts,
                    "local_experts": num_experts // dp_size if dp_size else None}
    else:
        expected = {"ep_size": dp_size}
    if not found:
        return gate(name, False, None, expected,
                    f"no '[EP Rank r/N] ... Local/global number of experts: a/b' line; it is "
                    f"{RANK0_ONLY}", [])
    splits = sorted({tuple(int(g) for g in m.groups()) for _, _, m in found})
    rank, size, local, glob = splits[0]
    observed = {"ep_rank": rank, "ep_size": size, "local_experts": local, "global_experts": glob}
    problems = []
    if len(splits) > 1:
        problems.append(f"{len(splits)} different EP splits logged: {splits}")
    if size != dp_size:
        problems.append(f"EP size {size} != dp_size {dp_size} (TP1 x DP)")
    if num_experts is not None and glob != num_experts:
        problems.append(f"global experts {glob} != the model's {num_experts}")
    if local * size != glob:
        problems.append(f"local {local} x EP size {size} != global {glob}")
    if num_experts is not None and num_experts % dp_size:
        problems.append(f"{num_experts} experts do not divide over {dp_size} ranks")
    if problems:
        return gate(name, False, observed, expected, "; ".join(problems) + f" ({RANK0_ONLY})",
                    evidence)
    note = "" if num_experts is not None else "; the model's expert count was not given"
    return gate(name, True, observed, expected,
                f"{local}/{glob} experts on each of {size} EP ranks; {RANK0_ONLY}{note}", evidence)


def _gate_prepare_finalize(lines, requested, log_name) -> Gate:
    name = "vllm_prepare_finalize"
    found = _find(lines, _PF_RE)
    evidence = [_quote(log_name, i, l) for i, l, _ in found]
    classes = sorted({m.group(1) for _, _, m in found})
    expected = PREPARE_FINALIZE.get(requested)
    if requested in REMOVED:
        return gate(name, False, classes, f"{requested}: removed in vLLM 0.24.0",
                    f"{requested!r} was replaced by vLLM; the prepare/finalize logged "
                    f"({', '.join(classes) or 'none'}) is the fallback's", evidence)
    if expected is None:
        return gate(name, False, classes, f"the prepare/finalize class of {requested!r}",
                    f"unknown: no prepare/finalize class known for {requested!r} "
                    f"(known: {', '.join(sorted(PREPARE_FINALIZE))})", evidence)
    if not found:
        return gate(name, False, [], expected,
                    f"no 'Using <X>PrepareAndFinalize<Y>' line; it is {RANK0_ONLY}", [])
    ok = classes == [expected]
    reason = f"{', '.join(classes)}; {RANK0_ONLY}"
    if not ok:
        reason = f"requested {requested!r} (expects {expected}) but logged {reason}"
    return gate(name, ok, classes, expected, reason, evidence)


def _gate_api_servers(lines, expected_servers, log_name) -> Gate:
    name = "vllm_api_servers_ready"
    found = [(i, l) for i, l in enumerate(lines, 1) for _ in range(l.count(_READY))]
    started = _find(lines, _API_STARTED_RE)
    evidence = [_quote(log_name, i, l) for i, l in found]
    evidence += [_quote(log_name, i, l) for i, l, _ in started]
    observed = {"startup_complete": len(found)}
    if started:
        observed["started_api_servers"] = int(started[-1][2].group(1))
    ok = len(found) == expected_servers
    reason = (f"{len(found)} 'Application startup complete.' lines, one per API server "
              f"(expected {expected_servers})")
    if not ok:
        reason += "; an API server that never completed startup cannot serve its share of requests"
    return gate(name, ok, observed, expected_servers, reason, evidence)


def no_legacy_gate(text: str, requested: str, *, log_name: str = "log") -> dict:
    """The no-fallback, no-legacy-buffer gate over any text: on a cluster, every pod's log
    joined (a legacy buffer is built, and its guard prints, on whichever rank built it)."""
    return _gate_no_legacy(_lines(text), requested, log_name).as_dict()


def _gate_no_legacy(lines, requested, log_name) -> Gate:
    name = "vllm_no_fallback_no_legacy_buffer"
    fallbacks = _find(lines, _FALLBACK_RE)
    legacy = [(i, l) for i, l in enumerate(lines, 1)
              if any(re.search(rf"\b{c}\b", l) for c in LEGACY_BUFFER_CLASSES)
              or _LEGACY_BUILT_RE.search(l)]
    evidence = ([_quote(log_name, i, l) for i, l, _ in fallbacks]
                + [_quote(log_name, i, l) for i, l in legacy])
    observed = {"fallback_warnings": len(fallbacks), "legacy_buffer_lines": len(legacy)}
    expected = {"fallback_warnings": 0, "legacy_buffer_lines": 0}
    if requested in ("deepep_high_throughput", "deepep_low_latency"):
        return skip(name, f"{requested!r} is built on DeepEP's legacy deep_ep.Buffer by design; "
                          "this gate guards the DeepEP V2 (ElasticBuffer) path", evidence)
    problems = []
    if fallbacks:
        problems.append(f"{len(fallbacks)} fallback warning line(s): vLLM replaced the "
                        "requested backend")
    if legacy:
        problems.append(f"{len(legacy)} line(s) name a legacy deep_ep.Buffer class "
                        f"({', '.join(LEGACY_BUFFER_CLASSES)}) or its construction")
    scope = ("; the fallback warning is logged by every process, the manager and prepare/finalize "
             "lines by rank 0 only")
    if problems:
        return gate(name, False, observed, expected, "; ".join(problems) + scope, evidence)
    why = ("no fallback warning in any process, and no manager or prepare/finalize built on the "
           "legacy deep_ep.Buffer")
    if requested == "allgather_reducescatter":
        why += " (allgather_reducescatter uses no DeepEP buffer at all)"
    return gate(name, True, observed, expected, why + scope, [])


def assert_backend(log_text: str, requested_backend: str, *, dp_size: int,
                   num_experts: int | None, log_name: str,
                   api_servers: int | None = None) -> list[dict]:
    """Gates proving which all-to-all backend vLLM actually served, from one vLLM log.

    ``log_text`` is the leader's log on a cluster (the lines checked here are logged by global
    rank 0 only) or the one log of a local serve. ``api_servers`` defaults to ``dp_size``
    (``vllm serve`` with DP > 1 defaults api_server_count to DP; pass the leader's own count on a
    cluster where it differs).
    """
    lines = _lines(log_text)
    r0pid = rank0_pid(log_text)
    expected_servers = dp_size if api_servers is None else api_servers
    return [
        _gate_manager(lines, requested_backend, log_name, r0pid).as_dict(),
        _gate_ep_split(lines, dp_size, num_experts, log_name).as_dict(),
        _gate_prepare_finalize(lines, requested_backend, log_name).as_dict(),
        _gate_api_servers(lines, expected_servers, log_name).as_dict(),
        _gate_no_legacy(lines, requested_backend, log_name).as_dict(),
    ]


# --- NCCL: per-rank evidence (lib.engines.nccl_logs, the same for every engine) ----------------
from lib.engines.nccl_logs import (  # noqa: E402  (re-exported: vllm_logs.per_rank_nccl, ...)
    _EFA_RE, _NCCL_COMM_RE, _NCCL_PREFIX_RE, _PROVIDER_RE, efa_provider_per_rank,
    env_setting_per_rank, gin_assigned_per_rank, nccl_comm_lines, per_rank_nccl)
from lib.engines import transport as _transport  # noqa: E402


def transport_gates(log_text: str, world: int, transport: str, *,
                    log_name: str = "log") -> list[dict]:
    """What the transport contract asks of every rank's log beyond the EFA provider: on
    gin_type5, that every rank read NCCL_GIN_TYPE=5 and NCCL_SYM_GIN_KERNELS_ENABLE=0 (a rank
    without them falls back to the CPU proxy or to NCCL's symmetric GIN kernels, silently:
    whn09/ep-benchmarks-efa measured decode 2.2x slower at 2 nodes, 5.4x at 4), and that NCCL
    assigned every rank a type-5 plugin (what it loaded, not what it asked). None on the other
    contracts: type 2 is NCCL's default for EFA, and intranode runs GIN off."""
    if transport != "gin_type5":
        return []
    wanted = {v.name: v.value for v in _transport.contract(transport)}
    return [env_setting_per_rank(log_text, world, var, wanted[var], log_name=log_name)
            for var in ("NCCL_GIN_TYPE", "NCCL_SYM_GIN_KERNELS_ENABLE")] + [
        gin_assigned_per_rank(log_text, world, int(wanted["NCCL_GIN_TYPE"]), log_name=log_name)]


# --- ElasticBuffer's timeouts, as the guide's vLLM patch 0002 says them on every rank ----------
# patches/0002-vllm-deepep-v2-elastic-buffer-timeouts.patch prints, once per process:
#   "[guide-0002] DeepEPV2All2AllManager rank R/W: ElasticBuffer num_gpu_timeout_secs=G
#    num_cpu_timeout_secs=C allow_hybrid_mode=H"
# (H: vllm.envs.VLLM_DEEPEP_V2_ALLOW_HYBRID_MODE, a bool, what the manager passes ElasticBuffer)
TIMEOUTS_PIN = "vllm_patch_deepep_v2_timeouts"
_TIMEOUTS_RE = re.compile(r"\[guide-0002\] DeepEPV2All2AllManager rank (\d+)/(\d+): ElasticBuffer "
                          r"num_gpu_timeout_secs=(\d+) num_cpu_timeout_secs=(\d+)"
                          r"(?: allow_hybrid_mode=(True|False))?")


# what a cluster serve's software applied: the guide's image applies 0002 in its Layer 7b
# (docker/Dockerfile), as a site scripts/vllm-site.sh made does; an image without it FAILs the
# gate (no rank says its timeouts), which is the point on 16 ranks
IMAGE_SITE_PATCHES = [{"site": "the guide's image (docker/Dockerfile Layer 7b)",
                       "patches": [{"pin": TIMEOUTS_PIN, "unchanged": True}]}]


def applied_patches(site_patches: list[dict] | None) -> set[str]:
    """The pins of the patches run.json's `site_patches` records as applied and unchanged."""
    return {p["pin"] for site in site_patches or [] for p in site.get("patches") or []
            if p.get("unchanged", True)}


def patch_0002_lines(log_text: str, world: int,
                     log_name: str = "log") -> tuple[dict[int, re.Match], list[str]]:
    """Patch 0002's line of each rank of a world of `world` ({rank: its match}, the last one of
    a rank that said it twice) and every such line quoted, in the log's order."""
    said: dict[int, re.Match] = {}
    evidence = []
    for i, line in enumerate(_lines(log_text), 1):
        m = _TIMEOUTS_RE.search(line)
        if m and int(m.group(2)) == world:
            said[int(m.group(1))] = m
            evidence.append(_quote(log_name, i, line))
    return said, evidence


def patch_0002_gates(log_text: str, world: int, *, mode: str,
                     site_patches: list[dict] | None,
                     gpu_s: int = _transport.ELASTIC_TIMEOUT_S,
                     cpu_s: int = _transport.ELASTIC_TIMEOUT_S,
                     log_name: str = "log") -> list[dict]:
    """What patch 0002's line says on every rank, gated: ElasticBuffer's timeouts (a SKIP where
    the site applied no 0002) and the DeepEP-V2 mode the serve was given (no gate there)."""
    return [elastic_timeouts_gate(log_text, world, site_patches=site_patches, gpu_s=gpu_s,
                                  cpu_s=cpu_s, log_name=log_name)] + deepep_v2_mode_gate(
        log_text, world, mode, site_patches=site_patches, log_name=log_name)


def elastic_timeouts_gate(log_text: str, world: int, *, site_patches: list[dict] | None,
                          gpu_s: int = _transport.ELASTIC_TIMEOUT_S,
                          cpu_s: int = _transport.ELASTIC_TIMEOUT_S,
                          log_name: str = "log") -> dict:
    """Gate: every rank 0..world-1 built its ElasticBuffer with the contract's timeouts, as
    patch 0002's line says. Only where the run's site applied 0002 (run.json `site_patches`):
    a run without it (every run recorded before 0002) is a SKIP saying so, never a FAIL."""
    name = "elastic_buffer_timeouts_per_rank"
    if TIMEOUTS_PIN not in applied_patches(site_patches):
        return skip(name, f"the run's vLLM site records no {TIMEOUTS_PIN} (run.json "
                    "site_patches): that vLLM passes ElasticBuffer no timeout, so DeepEP's "
                    "defaults (GPU 100 s, CPU 300 s) applied and no rank says them").as_dict()
    said, evidence = patch_0002_lines(log_text, world, log_name)
    seen = {rank: (int(m.group(3)), int(m.group(4))) for rank, m in said.items()}
    wrong = [rank for rank, values in seen.items() if values != (gpu_s, cpu_s)]
    missing = [r for r in range(world) if r not in seen]
    observed = {"ranks": sorted(seen), "missing": missing,
                "values": sorted({f"gpu={g} cpu={c}" for g, c in seen.values()})}
    expected = {"ranks": list(range(world)), "gpu_s": gpu_s, "cpu_s": cpu_s}
    if wrong:
        return gate(name, False, observed, expected,
                    f"rank(s) {', '.join(map(str, sorted(wrong)))} built ElasticBuffer with "
                    f"other timeouts than GPU {gpu_s} s / CPU {cpu_s} s", evidence[:64]).as_dict()
    if missing:
        return gate(name, False, observed, expected,
                    f"no [guide-0002] line from rank(s) {', '.join(map(str, missing))} of "
                    f"{world}, though the site applied {TIMEOUTS_PIN}", evidence[:64]).as_dict()
    return gate(name, True, observed, expected,
                f"every rank of {world} built ElasticBuffer with GPU {gpu_s} s / CPU {cpu_s} s "
                "(patch 0002's line, one per rank)", evidence[:64]).as_dict()


def deepep_v2_mode_gate(log_text: str, world: int, mode: str, *,
                        site_patches: list[dict] | None, log_name: str = "log") -> list[dict]:
    """Gate: every rank 0..world-1 passed ElasticBuffer the DeepEP-V2 mode the serve was given
    (`mode`, hybrid or direct: allow_hybrid_mode True or False), as patch 0002's line says; vLLM
    0.24.0 itself logs it only at DEBUG, and its default changed under the same argv (vLLM
    #54281, #57991). None where the site applied no 0002: no rank says it (every run recorded
    before this gate), and 04's "DeepEP-V2 mode given to every rank" is then what is known."""
    name = "deepep_v2_mode_per_rank"
    if TIMEOUTS_PIN not in applied_patches(site_patches):
        return []
    hybrid = mode == "hybrid"
    said, evidence = patch_0002_lines(log_text, world, log_name)
    seen = {rank: None if m.group(5) is None else m.group(5) == "True"
            for rank, m in said.items()}
    missing = [r for r in range(world) if seen.get(r) is None]
    wrong = sorted(r for r, ran in seen.items() if ran is not None and ran != hybrid)
    observed = {"ranks": sorted(r for r, ran in seen.items() if ran is not None),
                "allow_hybrid_mode": sorted({str(ran) for ran in seen.values() if ran is not None})}
    expected = {"ranks": list(range(world)), "allow_hybrid_mode": str(hybrid)}
    if wrong:
        return [gate(name, False, observed, expected,
                     f"rank(s) {', '.join(map(str, wrong))} passed ElasticBuffer "
                     f"allow_hybrid_mode={not hybrid}: not the {mode} mode the serve was given",
                     evidence[:64]).as_dict()]
    if missing:
        return [gate(name, False, observed, expected,
                     f"no rank line saying allow_hybrid_mode from rank(s) "
                     f"{', '.join(map(str, missing))} of {world}, though the site applied "
                     f"{TIMEOUTS_PIN}", evidence[:64]).as_dict()]
    return [gate(name, True, observed, expected,
                 f"every rank of {world} passed ElasticBuffer allow_hybrid_mode={hybrid} (the "
                 f"{mode} mode; patch 0002's line, one per rank)", evidence[:64]).as_dict()]


# --- startup time -------------------------------------------------------------------------------
def startup_seconds(log_text: str) -> float | None:
    """Seconds from vLLM's first timestamped log line to the last API server's startup.

    vLLM prefixes its lines "INFO 11-30 09:41:41 [file.py:N]" (month-day, no year, whole
    seconds); uvicorn's "Application startup complete." has no timestamp, so the time of the
    last timestamped line before the last of those is used. This is a lower bound of the time to
    ready: it leaves out the interpreter's start before vLLM's first line (TOOLCHAIN's "ready in
    81-101 s" was measured from launch). None when the log has no timestamps or never got ready.
    """
    lines = _lines(log_text)
    first = last_before_ready = None
    current = None
    for line in lines:
        m = _TS_RE.search(line)
        if m:
            mo, d, hh, mm, ss = (int(g) for g in m.groups())
            current = datetime(2000, mo, d, hh, mm, ss)  # 2000: a leap year, so 02-29 parses
            if first is None:
                first = current
        if _READY in line and current is not None:
            last_before_ready = current
    if first is None or last_before_ready is None:
        return None
    if last_before_ready < first:  # the year turned over during startup (Dec 31 -> Jan 1)
        last_before_ready = last_before_ready.replace(year=2001)
    return (last_before_ready - first).total_seconds()


# --- the serve's mode: eager or CUDA graphs, expert parallelism on or off ----------------------
# vLLM 0.24.0, every process: "Enforce eager set, disabling torch.compile and CUDAGraphs. ..."
# (../shared/fixtures/vllm-0.24.0-2xh200/vllm-allgather_reducescatter.log, line 16). Without
# --enforce-eager each worker captures graphs and logs "Graph capturing finished in N secs, took
# X GiB" (vllm/v1/worker/gpu_model_runner.py at 0.24.0; no recorded log holds it yet).
_EAGER_RE = re.compile(r"Enforce eager set, disabling torch\.compile and CUDAGraphs")
_GRAPHS_RE = re.compile(r"Graph capturing finished in (\d+) secs?, took ([\d.]+) GiB")


def compile_mode_gate(log_text: str, enforce_eager: bool, *, log_name: str = "log") -> dict:
    """Gate: the serve ran in the mode asked for (eager, or CUDA graphs captured)."""
    name = "vllm_compile_mode"
    lines = _lines(log_text)
    eager = _find(lines, _EAGER_RE)
    graphs = _find(lines, _GRAPHS_RE)
    observed = {"enforce_eager_lines": len(eager), "graph_capture_lines": len(graphs)}
    if enforce_eager:
        expected = {"enforce_eager_lines": ">= 1", "graph_capture_lines": 0}
        ok = bool(eager) and not graphs
        why = ("eager, as asked: vLLM logged 'Enforce eager set' and captured no CUDA graph"
               if ok else "asked for eager, but " + ("graphs were captured" if graphs else
                                                     "no 'Enforce eager set' line"))
        return gate(name, ok, observed, expected, why,
                    [_quote(log_name, i, l) for i, l, _ in (eager + graphs)[:4]]).as_dict()
    expected = {"enforce_eager_lines": 0, "graph_capture_lines": ">= 1"}
    ok = bool(graphs) and not eager
    seconds = [int(m.group(1)) for _, _, m in graphs]
    why = (f"CUDA graphs, as asked: {len(graphs)} 'Graph capturing finished' line(s) "
           f"({', '.join(f'{s} s' for s in seconds)})" if ok else
           "asked for CUDA graphs, but " + ("vLLM logged 'Enforce eager set'" if eager else
                                           "no 'Graph capturing finished' line"))
    return gate(name, ok, observed, expected, why,
                [_quote(log_name, i, l) for i, l, _ in (graphs + eager)[:4]]).as_dict()


# vLLM 0.24.0 (model_executor/layers/fused_moe/all2all_utils.py), once per worker process when
# DP > 1 and --enable-expert-parallel is not given: the MoE layers are then tensor-parallel
# across the DP ranks (FusedMoEParallelConfig flattens TP over DP: each rank holds a 1/DP slice
# of every expert) and tokens are gathered and reduce-scattered around each of them.
DP_WITHOUT_EP_LINE = "Detected DP deployment with no --enable-expert-parallel."
DP_WITHOUT_EP_MANAGER = MANAGER["allgather_reducescatter"]


def expert_parallel_off_gate(log_text: str, *, dp_size: int, log_name: str = "log") -> dict:
    """Gate for a serve WITHOUT --enable-expert-parallel, as vLLM 0.24.0 logs it (recorded on
    2x H200, results/gpu-2xh200-vllm-20261130d/06_multicomm/vllm-eager-noep.log): no EP split;
    with DP > 1, the fallback line and the AllGather+ReduceScatter manager and no other (every
    expert on every rank, sharded by tensor parallelism, not split by expert); with DP = 1, no
    manager at all."""
    name = "vllm_expert_parallel_off"
    lines = _lines(log_text)
    ep = _find(lines, _EP_RE)
    built = _find(lines, _MANAGER_RE)
    managers = sorted({m.group(1) for _, _, m in built})
    fallback = [(i, l) for i, l in enumerate(lines, 1) if DP_WITHOUT_EP_LINE in l]
    want_managers = [DP_WITHOUT_EP_MANAGER] if dp_size > 1 else []
    want_fallback = ">= 1" if dp_size > 1 else 0
    observed = {"ep_split_lines": len(ep), "all2all_managers": managers,
                "dp_fallback_lines": len(fallback)}
    ok = (not ep and managers == want_managers
          and (bool(fallback) if dp_size > 1 else not fallback))
    evidence = ([_quote(log_name, i, l) for i, l, _ in ep[:2]]
                + [_quote(log_name, i, l) for i, l, _ in built[:2]]
                + [_quote(log_name, i, l) for i, l in fallback[:1]])
    if ok:
        reason = ("no EP split; vLLM's DP fallback logged (MoE tensor-parallel across the "
                  f"{dp_size} DP ranks, tokens moved by {DP_WITHOUT_EP_MANAGER}: "
                  f"AllGather+ReduceScatter, not an expert all-to-all); {RANK0_ONLY} for the "
                  "fallback line" if dp_size > 1 else "no EP split and no all-to-all manager")
    elif ep:
        reason = "expert parallelism was not asked for, yet vLLM logged an EP split"
    elif managers != want_managers:
        reason = (f"all-to-all manager(s) {managers or 'none'} logged; without EP vLLM "
                  f"builds {want_managers or 'none'} at DP={dp_size}")
    else:
        reason = (f"the DP fallback line ({DP_WITHOUT_EP_LINE!r}) is missing at DP={dp_size}"
                  if dp_size > 1 else "a DP fallback line at DP=1")
    return gate(name, ok, observed,
                {"ep_split_lines": 0, "all2all_managers": want_managers,
                 "dp_fallback_lines": want_fallback}, reason, evidence).as_dict()


def api_servers_gate(log_text: str, expected_servers: int, *, log_name: str = "log") -> dict:
    """Gate: one "Application startup complete." per API server (vllm serve runs DP of them)."""
    return _gate_api_servers(_lines(log_text), expected_servers, log_name).as_dict()


# What a vLLM 0.24.0 server logs when it dies serving, earliest first in its log: a device-side
# assert prints its kernel's assertion line on every thread that failed it, then the worker's
# AcceleratorError, then the engine's "EngineCore encountered a fatal error" (recorded on 2x H200:
# results/gpu-2xh200-deepep-vllm-20261130d/06_multicomm/vllm-graphs-ep-1.log, line 687 on as grep counts).
_FATAL_RE = re.compile(r"Assertion .* failed|CUDA error: |AcceleratorError|"
                       r"encountered a fatal error|died unexpectedly")


def first_fatal_line(log_text: str, *, after_line: int = 0,
                     log_name: str = "log") -> str | None:
    """The log's first line, after `after_line`, that says why vLLM died, quoted
    ("log:line: text"), or None when it says nothing of the kind."""
    for lineno, line, _ in _find(_lines(log_text), _FATAL_RE):
        if lineno > after_line:
            return _quote(log_name, lineno, line)
    return None


# What vLLM 0.24.0's engine core dumps when it dies: the step it was running (dump_input.py),
# "(EngineCore_DP1 pid=N) ERROR ... Dumping scheduler output for model execution:
# SchedulerOutput(scheduled_new_reqs=[NewRequestData(..., prompt_token_ids_len=134, ...)], ...,
# total_num_scheduled_tokens=135, ...)", then "Dumping scheduler stats: SchedulerStats(
# num_running_reqs=2, num_waiting_reqs=0, ...)". Recorded on 2x H200 in the log named above.
_STEP_RE = re.compile(r"\((EngineCore\w*) pid=\d+\).*Dumping scheduler output for model execution")
_STEP_TOKENS_RE = re.compile(r"total_num_scheduled_tokens=(\d+)")
_NEW_PROMPT_RE = re.compile(r"NewRequestData\(req_id=[^,]*,prompt_token_ids_len=(\d+)")
_STATS_RE = re.compile(r"Dumping scheduler stats: SchedulerStats\(num_running_reqs=(\d+), "
                       r"num_waiting_reqs=(\d+)")


def crashed_step(log_text: str, *, log_name: str = "log") -> dict | None:
    """The step vLLM's engine core was running when it died, from its own dump: which engine
    core (which DP rank), how many tokens were scheduled, the prompt lengths of the requests new
    in that step, and how many requests were running and waiting; None when the log holds no
    dump (a server that did not die, or one that died before serving). A device-side assert is
    reported at the next synchronisation, so the faulting kernel may belong to the step before
    (vLLM schedules asynchronously): the dump says where it was, not what caused it."""
    lines = _lines(log_text)
    found = _find(lines, _STEP_RE)
    if not found:
        return None
    lineno, line, m = found[0]
    tokens = _STEP_TOKENS_RE.search(line)
    step = {"engine_core": m.group(1),
            "scheduled_tokens": int(tokens.group(1)) if tokens else None,
            "new_prompt_tokens": [int(n) for n in _NEW_PROMPT_RE.findall(line)],
            "running": None, "waiting": None, "quote": _quote(log_name, lineno, line)}
    for _, stats, s in _find(lines[lineno:], _STATS_RE):
        if _pid_of(stats) == _pid_of(line):
            step["running"], step["waiting"] = int(s.group(1)), int(s.group(2))
            break
    return step


def describe_step(step: dict) -> str:
    """One clause for a gate's reason: "EngineCore_DP1 was running a step of 135 scheduled tokens
    (new prompts of 134 tokens; 2 running, 0 waiting)"."""
    new = step["new_prompt_tokens"]
    parts = [f"new prompts of {', '.join(map(str, new))} tokens" if new else "no new prompt"]
    if step["running"] is not None:
        parts.append(f"{step['running']} running, {step['waiting']} waiting")
    tokens = step["scheduled_tokens"]
    return (f"{step['engine_core']} was running a step of "
            f"{'?' if tokens is None else tokens} scheduled token{'' if tokens == 1 else 's'} "
            f"({'; '.join(parts)})")
