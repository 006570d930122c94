"""On one GPU, outside the guide: what vLLM 0.26.0 (pin set `current`) answers, with its top
logprobs, for the same fixed prompts on the guide's seeded model, served eager and then with CUDA
graphs.

A copy of results/diagnostics/vllm-answers-1xh200-20261201/record.py (vLLM 0.24.0), changed only
where this tree changed (lib.models / lib.vllm_args are now lib.engines.models /
lib.engines.vllm_args), in its ready limits (the whole recording has to fit one device call),
in writing answers.json after each arm (a call cut short still brings back what was asked), and
in recording a failed request instead of dying with the server still up.
The earlier docstring follows.

(0.24.0:) what vLLM 0.24.0 answers, with its top logprobs, for a few fixed
prompts on the guide's seeded model, served eager and with CUDA graphs side by side.

Why: stage 06 compares arms of one model by throughput; whether an arm computes what the eager
arm computes is a separate question, and a check of it needs (1) vLLM's real answer format for
greedy completions with logprobs and (2) how far two correct serves of the same weights differ
(bf16, different kernels), against how far answers to different prompts differ.

Each serve is started by the guide's own argv builder (lib.vllm_args.vllm_serve, DP 1, no EP)
with the seeded model of flavor 'vllm' (lib.models, seed 0); each prompt is sent alone, then all
prompts at once (a batched step), as POST /v1/completions {max_tokens 4, temperature 0,
logprobs 20}. Usage: PYTHONPATH=<vllm site>:<repo> python3 record.py OUT_DIR
"""
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

REPO = os.environ.get("GUIDE_REPO", os.getcwd())
sys.path.insert(0, REPO)
from lib.engines import models  # noqa: E402
from lib.engines.vllm_args import vllm_serve  # noqa: E402

PROMPTS = [" ".join(["word"] * n) + f" {i}" for i, n in enumerate((3, 9, 17, 40, 77, 130,
                                                                   260, 500))]
REQUEST = {"max_tokens": 4, "temperature": 0, "logprobs": 20}


def post(port, body, timeout=120):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 json.dumps(body).encode(), {"content-type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=timeout).read())


def start(name, model_dir, port, eager, out_dir):
    argv, env = vllm_serve("local", model=model_dir, backend="allgather_reducescatter",
                           dp_size=1, dp_size_local=1, port=port, enforce_eager=eager,
                           max_model_len=2048, gpu_memory_utilization=0.3, ep_num_comms=1,
                           transport="intranode_nvlink", nccl_site=None, num_experts=None,
                           python=sys.executable, expert_parallel=False, deepep_dir=None,
                           inherited_pythonpath=os.environ.get("PYTHONPATH"))
    log = open(os.path.join(out_dir, f"vllm-{name}.log"), "w")
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    return {"name": name, "argv": argv, "proc": proc, "port": port, "t0": time.time()}


def wait_ready(server, limit):
    while time.time() - server["t0"] < limit and server["proc"].poll() is None:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{server['port']}/health",
                                      timeout=2).status == 200:
                return round(time.time() - server["t0"], 1)
        except OSError:
            time.sleep(2)
    return None


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    built = models.build(0, None, "vllm")
    model_dir = built["model_dir"]
    record = {"model": {k: v for k, v in built.items() if k != "model_dir"},
              "request": REQUEST, "prompts": PROMPTS, "arms": {}}
    # one after the other: two serves started together on one GPU misjudged its free memory
    # ("No available memory for the cache blocks", the first attempt's vllm-graphs.log)
    # ready limits: eager was ready in 44 s and graphs in 48 s with 0.24.0 here (the earlier
    # diagnostic); a first torch.compile of a new vLLM may take minutes
    for name, port, eager, limit in (("eager", 18601, True, 200), ("graphs", 18602, False, 300)):
        server = start(name, model_dir, port, eager, out_dir)
        ready = wait_ready(server, limit)
        arm = {"argv": server["argv"], "ready_s": ready, "alone": [], "batched": []}
        record["arms"][server["name"]] = arm
        if ready is None:
            stop(server, arm)
            save(record, out_dir)
            continue
        try:  # a failed request is recorded, and the server still stopped (not in 0.24.0's copy)
            for prompt in PROMPTS:
                arm["alone"].append(post(server["port"], {"model": model_dir, "prompt": prompt,
                                                          **REQUEST}))
            answers = [None] * len(PROMPTS)

            def one(i):
                try:
                    answers[i] = post(server["port"], {"model": model_dir,
                                                       "prompt": PROMPTS[i], **REQUEST})
                except Exception as exc:  # noqa: BLE001
                    answers[i] = {"error": repr(exc)}
            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
            [t.start() for t in threads]
            [t.join() for t in threads]
            arm["batched"] = answers
        except Exception as exc:  # noqa: BLE001
            arm["error"] = repr(exc)
        stop(server, arm)
        save(record, out_dir)
    save(record, out_dir)
    print(json.dumps({n: {"ready_s": a["ready_s"], "alone": len(a["alone"])}
                      for n, a in record["arms"].items()}), flush=True)


def save(record, out_dir):
    with open(os.path.join(out_dir, "answers.json"), "w") as f:
        json.dump(record, f, indent=1)


def stop(server, arm):
    arm["rc_before_stop"] = server["proc"].poll()
    if arm["rc_before_stop"] is None:
        try:
            os.killpg(server["proc"].pid, 15)
            server["proc"].wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(server["proc"].pid, 9)


if __name__ == "__main__":
    main(sys.argv[1])
