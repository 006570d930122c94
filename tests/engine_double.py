"""A serving engine's process on a Slurm node, stood in for: what a node without GPUs cannot run.

    python tests/engine_double.py LOGS ANSWERS -- <the engine's real argv>

Run as the step's program by a test, in place of the argv the engine rendered (which follows
`--` and is printed first, so the node's log holds what would have run). It prints the node's
log as the engine would (LOGS/composed-sglang-node<node rank>.log, composed from the engine's
own formats by tests/compose.py), then, on node rank 0 only, answers on the argv's --port what
the API answers (GET /health and /v1/models, POST /v1/chat/completions: the recorded bodies in
ANSWERS, models_response.json and chat_response.json of a recorded vLLM serve, served under the
argv's model name). A node rank > 0 serves no port: on a real node SGLang answers /health there
from a stub server, but here both nodes share one host and one port. It runs until stopped.
"""
from __future__ import annotations

import http.server
import json
import sys
import time
from pathlib import Path


def flag(argv: list[str], name: str, default: str = "") -> str:
    return argv[argv.index(name) + 1] if name in argv else default


def main(argv: list[str]) -> int:
    logs, answers = Path(argv[0]), Path(argv[1])
    real = argv[argv.index("--") + 1:]
    node, port = int(flag(real, "--node-rank", "0")), int(flag(real, "--port", "30000"))
    model = flag(real, "--model-path")
    print("engine-double: would run: " + " ".join(real), flush=True)
    sys.stdout.write((logs / f"composed-sglang-node{node}.log").read_text())
    sys.stdout.flush()
    if node:
        while True:
            time.sleep(3600)
    models = json.loads((answers / "models_response.json").read_text())
    for entry in models.get("data", []):
        entry["id"] = entry["root"] = model
    chat = json.loads((answers / "chat_response.json").read_text())
    chat["model"] = model

    class Answers(http.server.BaseHTTPRequestHandler):
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
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._send(chat)

    http.server.HTTPServer(("0.0.0.0", port), Answers).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
