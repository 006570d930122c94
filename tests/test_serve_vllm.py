"""lib.serve_vllm against a test double of vLLM fed only real vLLM 0.24.0 output.

vLLM cannot run on this CPU machine, so each test writes `vllm-double` into tmp_path: an
executable that takes exactly the argv lib.vllm_args builds (it is passed as `python`, so the
argv is `vllm-double -m vllm.entrypoints.cli.main serve MODEL --enable-expert-parallel ...`),
replays a REAL log recorded on two H200s (../shared/fixtures/vllm-0.24.0-2xh200/; for the CUDA
graphs and no-EP arms, the guide's own recording in results/gpu-2xh200-vllm-20261130d/) to stdout
line by line, up to the last "Application startup complete.", then serves /health, /v1/models
and /v1/chat/completions on --port (vLLM's OpenAI shapes, minimal) and logs each request in the
uvicorn access-log format of those logs; on SIGTERM it replays the recorded shutdown lines and
exits. Everything lib.serve_vllm does to it is real: door.start, HTTP, /proc, the stop by PID.
"""
from __future__ import annotations

import json
import shutil
import socket
import stat
import sys
import time
from pathlib import Path

import pytest

from lib.stages import registry as params
from lib.engines import server as served
from lib.engines import vllm_server as serve_vllm
from lib.core.door import REPO_ROOT, Door, read_transcript
from lib.core.errors import ParameterError
from lib.core.stage import Stage
from lib.engines.vllm_args import vllm_serve

FIXTURES = (Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
            / "vllm-0.24.0-2xh200")
# Real vLLM 0.24.0 logs recorded by the guide on 2x H200 (06 on allgather_reducescatter, the
# 128-expert model, NCCL_DEBUG=INFO): the arms no shared fixture covers
RECORDED_06 = (Path(__file__).resolve().parents[1] / "results" / "gpu-2xh200-vllm-20261130d"
               / "06_multicomm")
GRAPHS_LOG = RECORDED_06 / "vllm-graphs-ep.log"
NOEP_LOG = RECORDED_06 / "vllm-eager-noep.log"
DEEPEP_LOG = FIXTURES / "vllm-deepep_v2-run2.log"
# vLLM 0.24.0 on 2x H200: graphs+EP on deepep_v2, started beside an eager+EP deepep_v2 server,
# dies in CUDA graph capture (illegal memory access)
DEEPEP_BESIDE_DEEPEP_LOG = (Path(__file__).resolve().parents[1] / "results"
                            / "gpu-2xh200-deepep-vllm-20261130c" / "06_multicomm"
                            / "vllm-graphs-ep.log")
# vLLM 0.24.0 on 2x H200: graphs+EP on deepep_v2, served alone, ready, then dead on the first
# batched step of AIPerf's traffic (device-side assert, "index out of bounds")
DEEPEP_GRAPHS_UNDER_TRAFFIC_LOG = (Path(__file__).resolve().parents[1] / "results"
                                   / "gpu-2xh200-deepep-vllm-20261130d" / "06_multicomm"
                                   / "vllm-graphs-ep-1.log")
ALLGATHER_LOG = FIXTURES / "vllm-allgather_reducescatter-run2.log"
NUM_EXPERTS = 64  # the served model of those logs: 64 experts, 32/64 per rank on 2 GPUs
TIMEOUT_S = 20.0

# Two ranks' "Init COMPLETE" lines in NCCL's own format (quoted from a public log:
# tests/test_vllm_logs.py TWO_RANKS_COMPLETE); the double prints them when NCCL_DEBUG=INFO, as
# each vLLM worker does (the recorded logs ran without it).
NCCL_INIT_LINES = [
    "node0:23441:23666 [1] NCCL INFO ncclCommInitRank comm 0x55d761db2df0 rank 1 nranks 2 "
    "cudaDev 1 nvmlDev 1 busId 16000 commId 0xb3609cbb6ba7a88a - Init COMPLETE",
    "node0:23440:23664 [0] NCCL INFO ncclCommInitRank comm 0x563d5b2b3360 rank 0 nranks 2 "
    "cudaDev 0 nvmlDev 0 busId 10000 commId 0xb3609cbb6ba7a88a - Init COMPLETE",
]

# vLLM 0.24.0's answers (greedy, top-20 logprobs) to lib.agreement's prompts, eager and with CUDA
# graphs, recorded on 1x H200 (the diagnostic's README says how)
ANSWERS = REPO_ROOT / "results" / "diagnostics" / "vllm-answers-1xh200-20261201" / "answers.json"

pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"{FIXTURES} absent")

DOUBLE = r'''#!{python}
"""vllm-double: replays a real vLLM 0.24.0 log, then answers like its OpenAI server."""
import json, re, signal, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOG, MODE, RECORD, DELAY = {log!r}, {mode!r}, {record!r}, 0.002
GRAPHS_LOG, NOEP_LOG, DEEPEP_CRASH_LOG = {graphs_log!r}, {noep_log!r}, {deepep_crash_log!r}
TRAFFIC_CRASH_LOG, TRAFFIC_CRASH_ANY = {traffic_crash_log!r}, {traffic_crash_any!r}
ANSWERS, WRONG_ANSWERS = {answers!r}, {wrong_answers!r}
NCCL_LINES = {nccl_lines!r}
CLI = ["-m", "vllm.entrypoints.cli.main", "serve"]

def out(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()

args = sys.argv[1:]
if args[:3] != CLI or len(args) < 4 or "--port" not in args:
    out("vllm-double: usage: vllm-double -m vllm.entrypoints.cli.main serve MODEL ... --port P")
    sys.exit(2)
model, port = args[3], int(args[args.index("--port") + 1])
DEEPEP_EP = ("--enable-expert-parallel" in args and "--all2all-backend" in args
             and args[args.index("--all2all-backend") + 1].startswith("deepep"))
GRAPHS_ON_DEEPEP = DEEPEP_EP and "--enforce-eager" not in args
CRASH_ON_TRAFFIC = bool(TRAFFIC_CRASH_LOG and (GRAPHS_ON_DEEPEP or TRAFFIC_CRASH_ANY))
if CRASH_ON_TRAFFIC and GRAPHS_ON_DEEPEP:  # as recorded: ready, then dead at the first stream
    LOG = TRAFFIC_CRASH_LOG
elif "--enable-expert-parallel" not in args and NOEP_LOG:  # the no-EP arm's own recording
    LOG = NOEP_LOG
elif "--enforce-eager" not in args and GRAPHS_LOG:  # a serve with CUDA graphs, recorded
    LOG = GRAPHS_LOG
elif isinstance(LOG, dict):  # one recorded log per backend (a backend A/B)
    LOG = LOG[args[args.index("--all2all-backend") + 1]]
import os

def alive(pid):
    try:
        return open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[-1].split()[0] not in "ZX"
    except OSError:
        return False

if DEEPEP_CRASH_LOG and DEEPEP_EP:
    holders = os.path.join(os.path.dirname(RECORD), "deepep-holders")
    os.makedirs(holders, exist_ok=True)
    beside = [name for name in os.listdir(holders) if alive(int(name))]
    open(os.path.join(holders, str(os.getpid())), "w").close()
    if beside:  # a second DeepEP server on the same GPUs: what vLLM did on 2x H200, replayed
        for line in open(DEEPEP_CRASH_LOG, encoding="utf-8").read().splitlines():
            out(line)
        sys.exit(1)
with open(RECORD, "w") as fh:
    json.dump({{"argv": sys.argv, "env": {{k: os.environ.get(k) for k in
               ("VLLM_USE_FLASHINFER_SAMPLER", "EP_DISABLE_GIN", "NCCL_NVLS_ENABLE")}}}}, fh)

lines = open(LOG, encoding="utf-8").read().splitlines()
# The EP split line carries the served model's expert count (the recorded run served 64)
try:
    config = json.load(open(os.path.join(model, "config.json")))
    experts = config.get("num_experts", config.get("num_local_experts"))
    dp = int(args[args.index("--data-parallel-size") + 1])
    lines = [re.sub(r"Local/global number of experts: \d+/\d+",
                    f"Local/global number of experts: {{experts // dp}}/{{experts}}", l)
             for l in lines]
except (OSError, ValueError, KeyError):
    pass
GENERATED = [0] * 2  # vllm:generation_tokens_total per engine
if os.environ.get("NCCL_DEBUG") == "INFO" and not any("NCCL INFO" in l for l in lines):
    # each rank's init lines, NCCL's own format, where the recorded log ran without them
    at = max(i for i, l in enumerate(lines) if "Application startup complete." in l)
    lines[at:at] = NCCL_LINES
ready_at = max(i for i, l in enumerate(lines) if "Application startup complete." in l)
access = [i for i, l in enumerate(lines) if re.search(r'" \d{{3}} ', l) and "HTTP/1.1" in l]
shutdown_from = (max(access) if access else ready_at) + 1
prefix = re.match(r"(\(ApiServer_\d+ pid=\d+\) )", lines[ready_at]).group(1)

if MODE == "crash":  # starts like the real run, then dies before serving
    for line in lines[:20]:
        out(line); time.sleep(DELAY)
    sys.exit(1)

for line in lines[:ready_at + 1]:
    out(line); time.sleep(DELAY)

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):  # uvicorn's access-log line, as in the real log
        pass

    def answer(self, status, body):
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        host, cport = self.client_address[:2]
        out(f'{{prefix}}INFO:     {{host}}:{{cport}} - "{{self.command}} {{self.path}} HTTP/1.1" '
            f'{{status}} {{"OK" if status == 200 else "Not Found"}}')

    def do_GET(self):
        if self.path == "/metrics":  # Prometheus text, as vLLM 0.24.0 labels it per engine
            text = "# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
            text += "# TYPE vllm:generation_tokens_total counter\n"
            for e, n in enumerate(GENERATED):
                text += (f'vllm:generation_tokens_total{{{{engine="{{e}}",'
                         f'model_name="{{model}}"}}}} {{float(n)}}\n')
            data = text.encode()
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if self.path == "/health":
            return self.answer(200, None)  # vLLM: 200, empty body
        if self.path == "/v1/models":
            return self.answer(200, {{"object": "list", "data": [{{
                "id": model, "object": "model", "created": int(time.time()),
                "owned_by": "vllm", "root": model, "parent": None, "max_model_len": 2048}}]}})
        self.answer(404, {{"detail": "Not Found"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{{}}")
        if self.path == "/v1/completions":  # a greedy answer with logprobs, as vLLM recorded it
            recorded = json.load(open(ANSWERS, encoding="utf-8"))
            if body.get("prompt") not in recorded["prompts"]:
                return self.answer(400, {{"detail": "vllm-double: no recorded answer"}})
            i = recorded["prompts"].index(body["prompt"])
            arm = "eager" if "--enforce-eager" in args else "graphs"
            if WRONG_ANSWERS and arm == "graphs":  # a serve that computes something else
                i = (i + 1) % len(recorded["prompts"])
            return self.answer(200, {{**recorded["arms"][arm]["alone"][i],
                                      "model": body.get("model")}})
        if self.path != "/v1/chat/completions":
            return self.answer(404, {{"detail": "Not Found"}})
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        prompt = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
        GENERATED[hash(threading.current_thread().name) % 2] += n
        if CRASH_ON_TRAFFIC and body.get("stream"):
            # what vLLM wrote from its first fatal line on (a device-side assert on a batched
            # step), then the whole server gone, as its API server exited on 2x H200
            crash = open(TRAFFIC_CRASH_LOG, encoding="utf-8").read().splitlines()
            ready = max(i for i, l in enumerate(crash) if "Application startup complete." in l)
            fatal = next(i for i, l in enumerate(crash)
                         if i > ready and re.search(r"Assertion .* failed", l))
            for line in crash[fatal:]:
                out(line)
            os._exit(1)
        if body.get("stream"):  # server-sent events, one token per chunk, usage last
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("connection", "close")
            self.end_headers()
            base = {{"id": "chatcmpl-double", "object": "chat.completion.chunk",
                     "created": int(time.time()), "model": body.get("model")}}
            def send(obj):
                self.wfile.write(f"data: {{json.dumps(obj)}}\n\n".encode())
                self.wfile.flush()
            send({{**base, "choices": [{{"index": 0, "delta": {{"role": "assistant",
                  "content": ""}}, "finish_reason": None}}]}})
            for _ in range(n):
                time.sleep(0.001)
                send({{**base, "choices": [{{"index": 0, "delta": {{"content": " tok"}},
                      "finish_reason": None}}]}})
            send({{**base, "choices": [{{"index": 0, "delta": {{}}, "finish_reason": "length"}}]}})
            send({{**base, "choices": [], "usage": {{"prompt_tokens": prompt,
                  "completion_tokens": n, "total_tokens": prompt + n}}}})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True
            return
        self.answer(200, {{
            "id": "chatcmpl-double", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model"), "choices": [{{
                "index": 0, "message": {{"role": "assistant", "content": " tok" * n,
                                        "tool_calls": []}},
                "logprobs": None, "finish_reason": "length", "stop_reason": None}}],
            "usage": {{"prompt_tokens": prompt, "total_tokens": prompt + n,
                      "completion_tokens": n, "prompt_tokens_details": None}}}})

stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: stop.set())
server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
while not stop.wait(0.05):
    pass
server.shutdown()
server.server_close()
for line in lines[shutdown_from:]:
    out(line); time.sleep(DELAY / 4)
sys.exit(0)
'''


def make_double(tmp_path: Path, log, mode: str = "serve", *, graphs_log: Path | None = None,
                noep_log: Path | None = None,
                deepep_crash_log: Path | None = None,
                traffic_crash_log: Path | None = None,
                traffic_crash_any: bool = False,
                wrong_answers: bool = False) -> tuple[Path, Path]:
    """(the vllm-double executable, the JSON file where it records its argv and env). `log`: one
    recorded log, or {backend: log} to replay the one of the backend asked for; `graphs_log`
    and `noep_log`: the recorded logs replayed for a serve without --enforce-eager and one
    without --enable-expert-parallel (absent: `log`, whatever it says, and the gates judge);
    `deepep_crash_log`: replayed, then exit 1, by an EP serve on a DeepEP backend started while
    another such double is alive (absent: DeepEP servers coexist); `traffic_crash_log`: replayed
    by an EP serve with CUDA graphs on a DeepEP backend up to its ready line, then from its first
    failed assertion on at the first streamed request, and the double exits 1 (absent: such a
    serve answers like any other); `traffic_crash_any`: every serve dies so at its first streamed
    request, after replaying its own log up to ready. POST /v1/completions answers a prompt
    lib.agreement asks with vLLM's recorded answer (ANSWERS: an eager serve's for an eager one,
    the CUDA-graph serve's otherwise); `wrong_answers`: a serve with CUDA graphs answers each
    prompt with the next prompt's answer, as a serve computing something else would."""
    stem = log.stem if isinstance(log, Path) else "by-backend"
    record = tmp_path / f"double-{mode}-{stem}.json"
    path = tmp_path / "bin" / "vllm-double"
    path.parent.mkdir(parents=True, exist_ok=True)
    log = str(log) if isinstance(log, Path) else {k: str(v) for k, v in log.items()}
    path.write_text(DOUBLE.format(python=sys.executable, log=log, mode=mode,
                                  record=str(record), nccl_lines=NCCL_INIT_LINES,
                                  graphs_log=str(graphs_log) if graphs_log else None,
                                  noep_log=str(noep_log) if noep_log else None,
                                  deepep_crash_log=str(deepep_crash_log) if deepep_crash_log
                                  else None,
                                  traffic_crash_log=str(traffic_crash_log) if traffic_crash_log
                                  else None, traffic_crash_any=traffic_crash_any,
                                  answers=str(ANSWERS), wrong_answers=wrong_answers))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path, record


def nccl_site(tmp_path: Path) -> Path:
    """A site whose nvidia/nccl/lib/libnccl.so.2 is a harmless real library (libm), so the
    intranode transport's LD_PRELOAD loads cleanly into the double."""
    site = tmp_path / "site"
    lib = site / "nvidia" / "nccl" / "lib"
    lib.mkdir(parents=True)
    libm = next(p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib64/libm.so.6",
                            "/lib64/libm.so.6") if Path(p).exists())
    (lib / "libnccl.so.2").symlink_to(libm)
    return site


def make_stage(tmp_path: Path) -> Stage:
    run_dir = tmp_path / "run"
    return Stage("04_serve", params.resolve("04_serve", {}), run_dir, Door(run_dir, "04_serve"),
                 None)


def by_name(gates) -> dict:
    return {g.gate: g for g in gates}


def pid_running(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def assert_stopped(stage: Stage, server) -> None:
    assert by_name(stage.gates)["server stopped"].status == "PASS", stage.gates[-1]
    assert not pid_running(server.proc.pid)
    assert not listening(server.port)


def test_deepep_v2_log_replayed_all_backend_gates_pass(tmp_path):
    double, record = make_double(tmp_path, DEEPEP_LOG)
    site = nccl_site(tmp_path)
    stage = make_stage(tmp_path)
    model = str(tmp_path / "models" / "moe")
    started = time.monotonic()
    with serve_vllm.vllm_server(stage, model, gpus=2, backend="deepep_v2",
                                num_experts=NUM_EXPERTS, timeout_s=TIMEOUT_S,
                                python=str(double), nccl_site=site) as server:
        assert server.ready, stage.gates
        listed, _ = served.models_gate(stage, server)
        chat, answer = served.chat_gate(stage, server)
        stage.add(listed, chat)
    took = time.monotonic() - started
    gates = by_name(stage.gates)
    for name in serve_vllm.BACKEND_GATES:
        assert gates[name].status == "PASS", gates[name]
    assert server.backend_ok
    assert gates["vllm_all2all_manager"].observed["constructed"] == ["DeepEPV2All2AllManager"]
    assert gates["vllm_prepare_finalize"].observed == ["DeepEPV2PrepareAndFinalize"]
    manager_evidence = gates["vllm_all2all_manager"].evidence
    assert any(e.startswith("04_serve/vllm.log:52: ") for e in manager_evidence)
    assert gates["server ready"].status == "PASS"
    assert gates["/v1/models lists the model"].status == "PASS", gates["/v1/models lists the model"]
    assert gates["chat request answers with content and usage"].status == "PASS"
    assert answer["usage"]["completion_tokens"] == 16
    assert server.startup_s == 93.0  # 09:55:59 -> 09:57:32 in the recorded log
    # served before patch 0002 and the run records no site that applied it: SKIP, saying so
    timeouts = gates["elastic_buffer_timeouts_per_rank"]
    assert timeouts.status == "SKIP" and "records no vllm_patch_deepep_v2_timeouts" in \
        timeouts.reason
    assert_stopped(stage, server)

    # The flags are exactly lib.vllm_args's; only the program is the double.
    want_argv, want_env = vllm_serve("local", model=model, backend="deepep_v2", dp_size=2,
                                     dp_size_local=2, port=server.port, enforce_eager=True,
                                     transport="intranode_nvlink", nccl_site=site,
                                     python=str(double),
                                     max_model_len=serve_vllm.MAX_MODEL_LEN,
                                     gpu_memory_utilization=serve_vllm.GPU_MEMORY_UTILIZATION)
    seen = json.loads(record.read_text())
    assert seen["argv"] == want_argv == server.argv
    assert want_argv[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]
    assert seen["env"] == {"VLLM_USE_FLASHINFER_SAMPLER": "0", "EP_DISABLE_GIN": "1",
                           "NCCL_NVLS_ENABLE": "0"}
    starts = [e for e in read_transcript(stage.run_dir / "transcript.jsonl")
              if e["kind"] == "start"]
    assert len(starts) == 1 and starts[0]["log"] == "{run}/04_serve/vllm.log"
    assert starts[0]["env"]["VLLM_DEEPEP_V2_ALLOW_HYBRID_MODE"] == "1"

    # The artifact is the real log, whole: replayed startup, the double's requests, shutdown.
    log = (stage.dir / "vllm.log").read_text()
    real = DEEPEP_LOG.read_text().splitlines()
    assert log.splitlines()[:169] == real[:169]
    assert '"GET /health HTTP/1.1" 200 OK' in log
    assert log.splitlines()[-1] == real[-1]
    print(f"deepep_v2 replay: {took:.1f} s")

    # A replay starts nothing (the double is gone) and re-computes the same gates from the
    # recorded transcript, the backend gates from the recorded log read through the door.
    double.unlink()
    copy = tmp_path / "replayed"
    shutil.copytree(stage.run_dir, copy)
    again = Stage("04_serve", stage.params, copy, Door(copy, "04_serve", replay=True),
                  stage.run_dir)
    with serve_vllm.vllm_server(again, model, gpus=2, backend="deepep_v2",
                                num_experts=NUM_EXPERTS, timeout_s=TIMEOUT_S,
                                python=str(double), nccl_site=site) as replayed:
        assert replayed.ready and replayed.port == server.port
        again.add(served.models_gate(again, replayed)[0], served.chat_gate(again, replayed)[0])
    assert [g.as_dict() for g in again.gates] == [g.as_dict() for g in stage.gates]
    assert again.door.remaining() == 0


@pytest.mark.parametrize("ranks_saying, status, words", [
    ((), "FAIL", "no [guide-0002] line from rank(s) 0, 1 of 2"),
    ((1,), "FAIL", "no [guide-0002] line from rank(s) 0 of 2"),
    ((0, 1), "PASS", "every rank of 2 built ElasticBuffer with GPU 600 s / CPU 600 s"),
])
def test_a_site_that_applied_0002_gates_its_timeouts_on_every_rank(tmp_path, ranks_saying,
                                                                    status, words):
    """run.json says the run's vLLM site applied patch 0002: the recorded deepep_v2 log (served
    before 0002: no rank says its timeouts) FAILs naming both ranks; with the patch's line after
    the manager's (its print, per rank) from one rank, the other is named; from both, PASS; the
    DeepEP-V2 mode gate, read from the same line, alike."""
    real = DEEPEP_LOG.read_text().splitlines()
    at = next(i for i, l in enumerate(real) if "Using DeepEPV2All2AllManager" in l) + 1
    said = [f"(Worker_DP{r}_EP{r} pid={3397 + r}) [guide-0002] DeepEPV2All2AllManager rank "
            f"{r}/2: ElasticBuffer num_gpu_timeout_secs=600 num_cpu_timeout_secs=600 "
            f"allow_hybrid_mode=True" for r in ranks_saying]
    log = tmp_path / "vllm-deepep_v2-with-0002.log"
    log.write_text("\n".join(real[:at] + said + real[at:]) + "\n")
    double, _ = make_double(tmp_path, log)
    stage = make_stage(tmp_path)
    stage.run_dir.mkdir(parents=True, exist_ok=True)
    (stage.run_dir / "run.json").write_text(json.dumps({"site_patches": [
        {"site": str(tmp_path / "vllm-site"), "patches": [
            {"pin": "vllm_patch_deepep_v2_timeouts", "unchanged": True}]}]}))
    with serve_vllm.vllm_server(stage, str(tmp_path / "moe"), gpus=2, backend="deepep_v2",
                                num_experts=NUM_EXPERTS, timeout_s=TIMEOUT_S,
                                python=str(double), nccl_site=nccl_site(tmp_path)) as server:
        assert server.ready, stage.gates
    timeouts = by_name(stage.gates)["elastic_buffer_timeouts_per_rank"]
    assert timeouts.status == status and words in timeouts.reason, timeouts
    assert len(timeouts.evidence) == len(ranks_saying)
    # the same line says the DeepEP-V2 mode each rank passed ElasticBuffer: hybrid, as given
    # (VLLM_DEEPEP_V2_ALLOW_HYBRID_MODE=1, the default mode)
    mode = by_name(stage.gates)["deepep_v2_mode_per_rank"]
    assert mode.status == status, mode
    assert mode.observed["ranks"] == list(ranks_saying)


def test_allgather_log_while_deepep_v2_requested_fails_naming_the_built_manager(tmp_path):
    double, _ = make_double(tmp_path, ALLGATHER_LOG)
    stage = make_stage(tmp_path)
    with serve_vllm.vllm_server(stage, str(tmp_path / "moe"), gpus=2, backend="deepep_v2",
                                num_experts=NUM_EXPERTS, timeout_s=TIMEOUT_S,
                                python=str(double), nccl_site=nccl_site(tmp_path)) as server:
        assert server.ready
    gates = by_name(stage.gates)
    manager = gates["vllm_all2all_manager"]
    assert manager.status == "FAIL"
    assert manager.observed["constructed"] == ["AgRsAll2AllManager"]
    assert "vLLM built AgRsAll2AllManager" in manager.reason
    assert "DeepEPV2All2AllManager" in manager.reason
    assert gates["vllm_prepare_finalize"].status == "FAIL"
    assert "MoEPrepareAndFinalizeNaiveDPEPModular" in gates["vllm_prepare_finalize"].reason
    assert gates["vllm_ep_split"].status == "PASS"  # the split is right; the backend is not
    assert not server.backend_ok
    assert_stopped(stage, server)


def test_double_that_exits_at_once_fails_ready_with_log_tail(tmp_path):
    double, _ = make_double(tmp_path, DEEPEP_LOG, mode="crash")
    stage = make_stage(tmp_path)
    started = time.monotonic()
    with serve_vllm.vllm_server(stage, str(tmp_path / "moe"), gpus=2, backend="deepep_v2",
                                num_experts=NUM_EXPERTS, timeout_s=TIMEOUT_S,
                                python=str(double), nccl_site=nccl_site(tmp_path)) as server:
        assert not server.ready
    took = time.monotonic() - started
    gates = by_name(stage.gates)
    ready = gates["server ready"]
    assert ready.status == "FAIL"
    assert "vLLM exited with code 1" in ready.reason
    assert "Defaulting api_server_count to data_parallel_size (2)." in ready.reason  # log tail
    assert took < TIMEOUT_S
    for name in serve_vllm.BACKEND_GATES:
        assert gates[name].status == "SKIP" and "never became ready" in gates[name].reason
    assert_stopped(stage, server)


def test_bad_requests_refused_before_anything_starts():
    """What vllm_server is asked was refused before the stage opened: a removed backend by the
    stage's model (the one place it is said), one GPU by the local place (engine 'vllm' needs
    2 or more; tests/test_serve.py); the model's experts and the GPUs are the guide's own."""
    from lib.stages import registry

    for stage in ("04_serve", "05_sweep", "06_multicomm"):
        with pytest.raises(ParameterError, match="'all2all_backend' = 'naive'"):
            registry.resolve(stage, {"engine": "vllm", "all2all_backend": "naive"})


def test_a_second_deepep_server_beside_the_first_fails_its_ready_gate(tmp_path):
    """What 06 on deepep_v2 ran into on 2x H200: a second server holding a DeepEP buffer, started
    while the first is up, dies in CUDA graph capture. The double replays that recorded log; the
    `server ready` gate FAILs with the illegal memory access in its tail, and one DeepEP server
    beside an allgather_reducescatter one starts as before (05's backend A/B)."""
    double, _ = make_double(tmp_path, {"deepep_v2": DEEPEP_LOG,
                                       "allgather_reducescatter": ALLGATHER_LOG},
                            deepep_crash_log=DEEPEP_BESIDE_DEEPEP_LOG)
    site = nccl_site(tmp_path)
    stage = make_stage(tmp_path)
    model = str(tmp_path / "models" / "moe")

    def server(backend: str, name: str):
        return serve_vllm.vllm_server(stage, model, gpus=2, backend=backend,
                                      num_experts=NUM_EXPERTS, timeout_s=TIMEOUT_S,
                                      python=str(double), nccl_site=site, gate_prefix=name,
                                      log_name=f"{name}.log")

    with server("deepep_v2", "first") as first:
        assert first.ready
        with server("allgather_reducescatter", "allgather") as beside:
            assert beside.ready
        with server("deepep_v2", "second") as second:
            assert not second.ready
    gates = by_name(stage.gates)
    assert gates["first: server ready"].status == "PASS"
    assert gates["allgather: server ready"].status == "PASS"
    failed = gates["second: server ready"]
    assert failed.status == "FAIL" and failed.observed["exit_code"] == 1
    assert "cudaErrorIllegalAddress" in failed.reason
    assert gates["second: vllm_all2all_manager"].status == "SKIP"
    with server("deepep_v2", "after") as after:  # the first is gone: a DeepEP server starts again
        assert after.ready
