"""A serving engine's process on a Slurm node, stood in for: what a node without GPUs cannot run.

    python tests/engine_double.py LOGS ANSWERS -- <the engine's real argv>

Run as the step's program by a test, in place of the argv the engine rendered (which follows
`--` and is printed first, so the node's log holds what would have run). It prints the log the
engine would print, then the process of rank 0 answers on the argv's --port what the API answers
(GET /health and /v1/models, POST /v1/chat/completions: the recorded bodies in ANSWERS,
models_response.json and chat_response.json of a recorded vLLM serve, served under the argv's
model name). Which process it is, and so which log it prints (LOGS/*-<which><k>.log; none
found: nothing):

- SGLang (`--node-rank k`, one process per node): `node<k>`, the log tests/compose.py composed
  from SGLang 0.5.19's formats;
- TensorRT-LLM (`trtllm-serve`, one task per GPU of one srun world): `task<SLURM_PROCID>`, e.g.
  task 0 printing the public reproduction's recorded mpirun output of every rank.

Processes other than rank 0 serve no port: here every node shares one host and one port; with
ENGINE_DOUBLE_LATE_S set they print their log that many seconds late (after rank 0 answers).
It runs until stopped.

A streamed chat request (`"stream": true`, AIPerf's) is answered as OpenAI's server-sent events:
one chat.completion.chunk per output token (`max_tokens` / `max_completion_tokens` of them, the
recorded answer's words cycled, as `ignore_eos` asks), then a chunk with the usage when
`stream_options.include_usage`, then `data: [DONE]`. That is the OpenAI streaming format vLLM
and SGLang both serve; the token counts are the double's own (its words, not a tokenizer's).
"""
from __future__ import annotations

import http.server
import json
import os
import sys
import time
from pathlib import Path


# seconds a process other than rank 0 waits before it prints its log (a test's late node)
LATE_ENV = "ENGINE_DOUBLE_LATE_S"


def flag(argv: list[str], name: str, default: str = "") -> str:
    return argv[argv.index(name) + 1] if name in argv else default


def who(real: list[str]) -> tuple[str, int, str]:
    """(which log, this process's rank in it, the model it serves) from the engine's argv."""
    if "trtllm-serve" in real:
        return "task", int(os.environ.get("SLURM_PROCID", "0")), real[real.index("serve") + 1]
    return "node", int(flag(real, "--node-rank", "0")), flag(real, "--model-path")


def chunk(base: dict, delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
    body = {"id": base.get("id", "chatcmpl-double"), "object": "chat.completion.chunk",
            "created": base.get("created", 0), "model": base["model"],
            "choices": [] if usage else [{"index": 0, "delta": delta,
                                          "finish_reason": finish}]}
    if usage:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def streamed(chat: dict, request: dict) -> list[bytes]:
    """The events of one streamed answer (see the module's docstring)."""
    words = (chat["choices"][0]["message"]["content"] or "token").split() or ["token"]
    count = int(request.get("max_completion_tokens") or request.get("max_tokens") or 16)
    events = [chunk(chat, {"role": "assistant", "content": ""})]
    events += [chunk(chat, {"content": (" " if k else "") + words[k % len(words)]})
               for k in range(count)]
    events.append(chunk(chat, {}, finish="length"))
    if (request.get("stream_options") or {}).get("include_usage"):
        prompt = sum(len(str(m.get("content", "")).split()) for m in request.get("messages", []))
        events.append(chunk(chat, {}, usage={"prompt_tokens": prompt, "completion_tokens": count,
                                             "total_tokens": prompt + count}))
    return events + [b"data: [DONE]\n\n"]


def main(argv: list[str]) -> int:
    logs, answers = Path(argv[0]), Path(argv[1])
    real = argv[argv.index("--") + 1:]
    which, rank, model = who(real)
    port = int(flag(real, "--port", "30000"))
    print("engine-double: would run: " + " ".join(real), flush=True)
    log = sorted(logs.glob(f"*-{which}{rank}.log"))
    if rank:  # a node's output reaching the shared file system late (srun under load)
        time.sleep(float(os.environ.get(LATE_ENV, "0")))
    if log:
        sys.stdout.write(log[0].read_text())
        sys.stdout.flush()
    if rank:
        while True:
            time.sleep(3600)
    models = json.loads((answers / "models_response.json").read_text())
    for entry in models.get("data", []):
        entry["id"] = entry["root"] = model
    chat = json.loads((answers / "chat_response.json").read_text())
    chat["model"] = model

    class Answers(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # the log is the engine's, as printed above
            pass

        def _send(self, body: dict | None) -> None:
            data = json.dumps(body or {}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self._send(models if self.path.startswith("/v1/models") else None)

        def do_POST(self) -> None:  # noqa: N802
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0))
                                 or b"{}")
            if not request.get("stream"):
                self._send(chat)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for event in streamed(chat, request):
                self.wfile.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

    http.server.ThreadingHTTPServer(("0.0.0.0", port), Answers).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
