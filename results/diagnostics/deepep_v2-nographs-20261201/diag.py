"""On the device, outside the guide: localise the graphs+EP deepep_v2 crash of run
gpu-2xh200-deepep-vllm-20261130d. The recorded argv and env of that serve (graphs-start.json, as
the transcript holds them), plus CUDA_LAUNCH_BLOCKING=1 so the failing kernel names itself; then
8 concurrent streamed chats of ~130 words (the batched step that crashed it), and the log kept.
argv[1] = variant: "graphs" (as recorded) or "nographs" (compiled, cudagraph_mode NONE: vLLM
0.24.0 still picks the no-expand layout, since it keys on enforce_eager; a crash there is the
layout, not graph capture/replay). Log: /tmp/diag-<variant>.log."""
import json, os, subprocess, sys, threading, time, urllib.request

entry = json.load(open(os.path.join(os.path.dirname(__file__), "graphs-start.json")))
repo, out = "/tmp/g1", "/tmp"
subst = lambda s: s.replace("{repo}", repo).replace("{python}", sys.executable)
argv = [subst(a) for a in entry["key"]]
port = 18990
argv[argv.index("--port") + 1] = str(port)
variant = sys.argv[1] if len(sys.argv) > 1 else "graphs"
if variant == "nographs":
    argv += ["--compilation-config", '{"cudagraph_mode": "NONE"}']
print("variant", variant, flush=True)
env = {**os.environ, **{k: subst(v) for k, v in entry["env"].items()}, "CUDA_LAUNCH_BLOCKING": "1"}
env["PYTHONPATH"] = env["PYTHONPATH"] + ":" + os.environ.get("PYTHONPATH", "")
log = open(f"{out}/diag-{variant}.log", "w")
proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
t0 = time.time()
while time.time() - t0 < 420 and proc.poll() is None:
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
            break
    except OSError:
        time.sleep(3)
print(f"ready after {time.time() - t0:.0f} s, rc {proc.poll()}", flush=True)
model = argv[4]
def chat(i):
    body = json.dumps({"model": model, "max_tokens": 32, "stream": True, "ignore_eos": True,
                       "messages": [{"role": "user", "content": " ".join(["word"] * 130)}]})
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                     body.encode(), {"content-type": "application/json"})
        print(i, len(urllib.request.urlopen(req, timeout=60).read()), flush=True)
    except Exception as exc:
        print(i, "error", exc, flush=True)
threads = [threading.Thread(target=chat, args=(i,)) for i in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
time.sleep(20)
print("rc after traffic", proc.poll(), flush=True)
os.killpg(proc.pid, 15); time.sleep(15)
try:
    os.killpg(proc.pid, 9)
except ProcessLookupError:
    pass
