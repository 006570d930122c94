"""The test kubelet: the only simulated part of the test cluster (not a test file).

No kubelet with GPUs can run here, so this double plays one for any number of nodes of a
KubePlane (tests/kubeplane.py). It

* serves the kubelet endpoints the API server proxies to (HTTPS, self-signed; the API server does
  not verify kubelet certificates): ``GET /containerLogs/{ns}/{pod}/{container}`` with tailLines,
  limitBytes, timestamps, sinceSeconds and follow=true (streams until the container ends), and
  ``/exec/{ns}/{pod}/{container}?command=..`` as a websocket (``v5.channel.k8s.io``, also v4):
  channel 1 stdout, 2 stderr, 3 the status JSON (Failure with an ExitCode cause for a non-zero
  exit, so kubectl prints "command terminated with exit code N");
* watches the pods bound to its nodes (polls the API every `poll` seconds with the plane's token)
  and drives each pod whose name matches a Script through its scripted lifecycle, patching
  ``pods/status`` (phase, conditions, containerStatuses, podIP, hostIP, startTime); a pod that
  matches no Script is left Pending, its status untouched (see `unscripted`);
* finalizes pods being deleted (DELETE with gracePeriodSeconds=0, as a kubelet does once the
  containers are gone), then forgets them.

Logs are always real files handed in by the caller (recorded on real hardware); the double never
invents log text. Restarts (restartPolicy Always/OnFailure after an exit) are not modelled: an
exited container leaves the pod Succeeded or Failed.

    double = KubeletDouble(plane, [Script("ep-*", {"vllm": Container(log=path, execs={
        ("nvidia-smi", "-L"): Exec("GPU 0: ...\\n")})}, running_after=0.5)]).start()
    plane.add_node("p5en-0", kubelet_port=double.port)   # or double.add_node("p5en-0")
    ...
    double.stop()
"""
from __future__ import annotations

import base64
import datetime as dt
import fnmatch
import hashlib
import ipaddress
import json
import shlex
import socket
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
import ssl
import tempfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

try:  # tests/ on sys.path (pytest's default rootdir-less import mode)
    from kubeplane import Api, ApiError, KubePlane, free_port, make_serving_cert
except ImportError:  # imported as tests.kubelet_double from the repository root
    from tests.kubeplane import Api, ApiError, KubePlane, free_port, make_serving_cert

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
EXEC_PROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")
CH_STDOUT, CH_STDERR, CH_STATUS = 1, 2, 3
# A runtime's exec does not answer in the handshake's instant (containerd starts a process
# first). kubectl needs that: client-go's websocket executor reads frames in one goroutine
# while another makes its streams, and discards a frame for a stream not made yet ("Unknown
# stream id N, discarding message", remotecommand/websocket.go); seen once in CI under load,
# a /v1/models answer lost and kubectl exiting 0 with no stdout.
EXEC_START_S = 0.05


# ---- the script ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Exec:
    """What `kubectl exec` of one argv answers. `then`: called (no arguments) as the request
    arrives, before the answer is sent: a fault the test makes happen at that point of a stage
    (KubeletDouble.end_now, evict, lose_node), so the stage's next call sees it."""
    stdout: str | bytes = ""
    exit_code: int = 0
    stderr: str | bytes = ""
    then: Callable[[], None] | None = field(default=None, compare=False)


@dataclass
class Container:
    """One container's script: its log (a real recorded file), exec answers keyed by argv (a tuple,
    or a string split with shlex), its exit code when the pod's script ends it, its imageID."""
    log: Path | str | None = None
    execs: Mapping[tuple[str, ...] | str, Exec] = field(default_factory=dict)
    exit_code: int = 0
    image_id: str | None = None
    _turns: dict = field(default_factory=dict, repr=False, compare=False)

    def answer(self, argv: Sequence[str]) -> Exec | None:
        """The scripted answer; a list of answers is given in turn, its last one repeated (a
        counter read before and after some work: vLLM's /metrics around an AIPerf cell)."""
        for key, ans in self.execs.items():
            if tuple(shlex.split(key) if isinstance(key, str) else key) == tuple(argv):
                if isinstance(ans, list):
                    turn = self._turns.get(key, 0)
                    self._turns[key] = turn + 1
                    return ans[min(turn, len(ans) - 1)]
                return ans
        return None


@dataclass
class Script:
    """The lifecycle of every pod whose name equals `pod` or matches it as an fnmatch pattern.

    containers: container name (or fnmatch pattern) -> Container; a container of the pod that
    matches none gets an empty Container (no log, no execs).
    Timeline, from when the double first sees the pod bound to its node:
      running_after s  -> phase Running, containers running (None: stays Pending; with
                          waiting_reason the containers show waiting with that reason)
      + ready_after s  -> Ready and ContainersReady True (None: never ready)
      + exit_after s   -> (counted from Running) the containers terminate with their exit codes:
                          phase Succeeded when all are 0, else Failed (None: stays Running)
    image_id: the default imageID, e.g. "docker-pullable://repo@sha256:<64 hex>".
    pod_ips: None gives every pod podIP 127.0.0.1 (the node's InternalIP); a CIDR such as
    "10.244.0.0/16" gives each pod its own address from it. The real Endpoints controller
    refuses loopback addresses ("may not be in the loopback range"), so a Service only lists
    pods that have a pod_ips address."""
    pod: str
    containers: Mapping[str, Container] = field(default_factory=dict)
    running_after: float | None = 0.2
    ready_after: float | None = 0.0
    exit_after: float | None = None
    waiting_reason: str | None = None
    image_id: str | None = None
    pod_ips: str | None = None
    # with running_after None: (seconds after first sight, waiting reason, its message), each
    # posted once when due, the pod Pending throughout (an image pull: ErrImagePull, then
    # ImagePullBackOff, as the kubelet alternates them)
    waiting_turns: Sequence[tuple[float, str, str | None]] = ()

    def matches(self, name: str) -> bool:
        return name == self.pod or fnmatch.fnmatchcase(name, self.pod)

    def container(self, name: str) -> Container:
        if name in self.containers:
            return self.containers[name]
        for pattern, c in self.containers.items():
            if fnmatch.fnmatchcase(name, pattern):
                return c
        return Container()


# ---- per-pod state ---------------------------------------------------------------------------
@dataclass
class PodState:
    namespace: str
    name: str
    uid: str
    node: str
    spec: dict
    script: Script | None
    seen: float                      # monotonic, when first seen bound
    seen_wall: float
    running_at: float | None = None  # monotonic
    running_wall: float | None = None
    ready: bool = False
    finished_at: float | None = None
    finished_wall: float | None = None
    phase: str = "Pending"
    pod_ip: str = "127.0.0.1"
    waiting_posted: bool = False
    gone: bool = False
    waiting_turn: int = -1                     # the last of Script.waiting_turns posted
    waiting_now: tuple[str, str | None] | None = None
    frozen: bool = False                       # a fault set its status: the script stops
    fault: dict = field(default_factory=dict)  # what end_now / evict / lose_node set

    def terminated(self) -> bool:
        return self.finished_at is not None or self.gone


def _ts(t: float, nanos: bool = False) -> str:
    d = dt.datetime.fromtimestamp(t, dt.timezone.utc)
    if nanos:
        return d.strftime("%Y-%m-%dT%H:%M:%S.") + f"{d.microsecond:06d}000Z"
    return d.strftime("%Y-%m-%dT%H:%M:%SZ")


def _hex(*parts: str) -> str:
    return hashlib.sha256("/".join(parts).encode()).hexdigest()


# ---- the double ------------------------------------------------------------------------------
class KubeletDouble:
    """Plays the kubelet of `nodes` (None: every node whose kubelet port is this double's)."""

    def __init__(self, plane: KubePlane, scripts: Sequence[Script] = (), nodes: Sequence[str] | None = None,
                 port: int | None = None, poll: float = 0.2, workdir: Path | None = None):
        if plane.api is None or plane.ca_file is None:
            raise RuntimeError("start the KubePlane before its kubelet double")
        self.plane = plane
        self.scripts: list[Script] = list(scripts)
        self.nodes: set[str] | None = set(nodes) if nodes is not None else None
        self.port = port or free_port()
        self.poll = poll
        self.workdir = Path(workdir) if workdir else (plane.workdir or Path(tempfile.mkdtemp())) / "kubelet-double"
        self.pods: dict[str, PodState] = {}            # uid -> state
        self.unscripted: set[tuple[str, str]] = set()  # (namespace, name) seen bound, left alone
        self.errors: list[str] = []                    # API errors met by the lifecycle thread
        self.requests: list[tuple[str, str]] = []      # (method, path) served, for tests
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server: _Server | None = None
        self._node_ports: dict[str, int] = {}
        self._next_ip: dict[str, Any] = {}             # CIDR -> iterator of free host addresses
        self._api = Api(plane.server, plane.token, plane.ca_file)

    # -- scripts and nodes --
    def add_script(self, script: Script) -> Script:
        with self._lock:
            self.scripts.append(script)
        return script

    def script_for(self, pod_name: str) -> Script | None:
        with self._lock:
            for s in reversed(self.scripts):  # the latest added wins
                if s.matches(pod_name):
                    return s
        return None

    def add_node(self, name: str, **kw: Any) -> dict:
        """plane.add_node with this double as the node's kubelet."""
        if self.nodes is not None:
            self.nodes.add(name)
        return self.plane.add_node(name, kubelet_port=self.port, **kw)

    def _my_node(self, node: str) -> bool:
        if self.nodes is not None:
            return node in self.nodes
        return node in self._node_ports and self._node_ports[node] == self.port

    # -- start / stop --
    def start(self) -> "KubeletDouble":
        self.workdir.mkdir(parents=True, exist_ok=True)
        crt, key = make_serving_cert(self.workdir, "kubelet")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(crt, key)
        self._server = _Server(("127.0.0.1", self.port), _Handler, ctx, self)
        for target, name in ((self._server.serve_forever, "kubelet-double-http"),
                             (self._loop, "kubelet-double-lifecycle")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        """Stop the server and the lifecycle thread; close every socket. Idempotent."""
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server.close_streams()
            self._server = None
        for t in self._threads:
            t.join(timeout=10)
        self._threads = []
        self._api.close()

    def __enter__(self) -> "KubeletDouble":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- lookups for the server --
    def find(self, namespace: str, name: str) -> PodState | None:
        with self._lock:
            for st in self.pods.values():
                if st.namespace == namespace and st.name == name and not st.gone:
                    return st
        return None

    # -- the lifecycle thread --
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - kept for the test to see; the loop goes on
                self.errors.append(f"{type(exc).__name__}: {exc}")
                self._api.close()
            self._stop.wait(self.poll)

    def _tick(self) -> None:
        if self.nodes is None:
            nodes = self._api.get("/api/v1/nodes")["items"]
            self._node_ports = {n["metadata"]["name"]:
                                n.get("status", {}).get("daemonEndpoints", {}).get("kubeletEndpoint", {})
                                .get("Port") for n in nodes}
        pods = self._api.get("/api/v1/pods")["items"]
        now, wall = time.monotonic(), time.time()
        alive: set[str] = set()
        for pod in pods:
            meta, spec = pod["metadata"], pod["spec"]
            node = spec.get("nodeName")
            if not node or not self._my_node(node):
                continue
            uid = meta["uid"]
            alive.add(uid)
            with self._lock:
                st = self.pods.get(uid)
                if st is None:
                    script = self.script_for(meta["name"])
                    st = PodState(meta["namespace"], meta["name"], uid, node, spec, None, now, wall)
                    self.pods[uid] = st
                    self.unscripted.add((st.namespace, st.name))
                if st.script is None and (script := self.script_for(st.name)) is not None:
                    self._attach(st, script, now, wall)  # on first sight, or a script added later
            if meta.get("deletionTimestamp"):
                self._finalize(st)
                continue
            if st.script is not None:
                self._advance(st, pod, now, wall)
        with self._lock:  # deleted elsewhere (e.g. grace period 0, or the node's pods GC'd)
            for uid in list(self.pods):
                if uid not in alive:
                    self.pods[uid].gone = True
                    del self.pods[uid]

    def _attach(self, st: PodState, script: Script, now: float, wall: float) -> None:
        st.script, st.seen, st.seen_wall = script, now, wall
        self.unscripted.discard((st.namespace, st.name))
        if script.pod_ips:
            hosts = self._next_ip.setdefault(script.pod_ips, ipaddress.ip_network(script.pod_ips).hosts())
            st.pod_ip = str(next(hosts))

    def _finalize(self, st: PodState) -> None:
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                "preconditions": {"uid": st.uid}}
        try:
            self._api.delete(f"/api/v1/namespaces/{st.namespace}/pods/{st.name}", body, ok=(404, 409))
        finally:
            with self._lock:
                st.gone = True
                self.pods.pop(st.uid, None)
                self.unscripted.discard((st.namespace, st.name))

    def _advance(self, st: PodState, pod: dict, now: float, wall: float) -> None:
        sc = st.script
        assert sc is not None
        if st.finished_at is not None or st.frozen:
            return
        changed = False
        if st.running_at is None:
            if sc.running_after is None and sc.waiting_turns:
                due = [k for k, turn in enumerate(sc.waiting_turns) if now - st.seen >= turn[0]]
                if due and due[-1] > st.waiting_turn:
                    st.waiting_turn = due[-1]
                    st.waiting_now = tuple(sc.waiting_turns[due[-1]][1:])
                    self._patch(st, pod, "Pending")
                return
            if sc.running_after is None or now - st.seen < sc.running_after:
                if sc.running_after is None and sc.waiting_reason and not st.waiting_posted:
                    st.waiting_posted = True
                    self._patch(st, pod, "Pending")
                return
            st.running_at, st.running_wall = now, wall
            st.phase = "Running"
            changed = True
        if (not st.ready and sc.ready_after is not None and now - st.running_at >= sc.ready_after
                and not (sc.exit_after is not None and now - st.running_at >= sc.exit_after)):
            st.ready = True
            changed = True
        if sc.exit_after is not None and now - st.running_at >= sc.exit_after:
            codes = [sc.container(c["name"]).exit_code for c in st.spec["containers"]]
            st.finished_at, st.finished_wall = now, wall
            st.ready = False
            st.phase = "Succeeded" if all(c == 0 for c in codes) else "Failed"
            changed = True
        if changed:
            self._patch(st, pod, st.phase)

    def _patch(self, st: PodState, pod: dict, phase: str) -> None:
        sc = st.script
        assert sc is not None
        started = _ts(st.running_wall) if st.running_wall else None
        ready = "True" if st.ready else "False"
        now = _ts(time.time())
        statuses = []
        for c in st.spec["containers"]:
            cs = sc.container(c["name"])
            image = c.get("image", "")
            image_id = cs.image_id or sc.image_id or f"docker-pullable://{image.split(':')[0]}@sha256:{_hex(image)}"
            s: dict[str, Any] = {"name": c["name"], "image": image, "imageID": image_id,
                                 "containerID": f"containerd://{_hex(st.uid, c['name'])}",
                                 "ready": st.ready, "restartCount": 0, "started": phase == "Running"}
            fault = st.fault
            if phase == "Pending":
                reason, message = st.waiting_now or (sc.waiting_reason or "ContainerCreating", None)
                s["state"] = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
                s["imageID"] = ""
                del s["containerID"]
            elif phase == "Running" and fault.get("restarted"):  # restartPolicy Always, after an exit
                s["restartCount"] = 1
                s["lastState"] = {"terminated": {
                    "exitCode": fault["exit_code"], "reason": fault["reason"], "startedAt": started,
                    "finishedAt": _ts(fault["at"]), "containerID": s["containerID"]}}
                s["state"] = {"waiting": {"reason": "CrashLoopBackOff", "message": (
                    f"back-off 10s restarting failed container={c['name']} "
                    f"pod={st.name}_{st.namespace}({st.uid})")}}
                s["started"] = False
            elif phase == "Running":
                s["state"] = {"running": {"startedAt": started}}
            else:
                code = fault.get("exit_code", cs.exit_code)
                s["state"] = {"terminated": {"exitCode": code, "reason": fault.get("reason") or (
                                                 "Completed" if code == 0 else "Error"),
                                             "startedAt": started, "finishedAt": _ts(st.finished_wall or time.time()),
                                             "containerID": s["containerID"]}}
            statuses.append(s)
        conditions = [{"type": "Initialized", "status": "True", "lastTransitionTime": now}]
        if phase == "Pending":
            conditions += [{"type": t, "status": "False", "lastTransitionTime": now,
                            "reason": "ContainersNotReady"} for t in ("Ready", "ContainersReady")]
        else:
            reason = {"Running": None, "Succeeded": "PodCompleted", "Failed": "PodCompleted"}[phase]
            for t in ("Ready", "ContainersReady"):
                cond: dict[str, Any] = {"type": t, "status": ready, "lastTransitionTime": now}
                if reason or ready == "False":
                    cond["reason"] = reason or "ContainersNotReady"
                conditions.append(cond)
        status: dict[str, Any] = {
            "phase": phase, "conditions": conditions, "containerStatuses": statuses,
            "hostIP": "127.0.0.1", "startTime": _ts(st.seen_wall),
        }
        if phase != "Pending":
            status["podIP"] = st.pod_ip
            status["podIPs"] = [{"ip": st.pod_ip}]
        if st.fault.get("pod_reason"):  # the kubelet's eviction: the pod's own reason and message
            status["reason"], status["message"] = st.fault["pod_reason"], st.fault["pod_message"]
        try:
            self._api.patch(f"/api/v1/namespaces/{st.namespace}/pods/{st.name}/status",
                            {"status": status}, kind="strategic")
        except ApiError as exc:
            if exc.status != 404:  # deleted meanwhile: the next tick forgets it
                raise

    # -- what the server answers --
    def log_bytes(self, st: PodState, container: str) -> bytes:
        assert st.script is not None
        path = st.script.container(container).log
        return Path(path).read_bytes() if path else b""

    def wait_container_end(self, st: PodState, stop: threading.Event) -> None:
        while not (st.terminated() or stop.is_set() or self._stop.is_set()):
            time.sleep(0.05)


# ---- HTTPS server ----------------------------------------------------------------------------
class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], handler: type, ctx: ssl.SSLContext, double: KubeletDouble):
        self.ctx, self.double = ctx, double
        self.closing = threading.Event()
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(addr, handler)

    def finish_request(self, request: socket.socket, client_address: Any) -> None:
        # The TLS handshake in the request's thread, not in the accept loop.
        try:
            tls = self.ctx.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return
        with self._open_lock:
            self._open.add(tls)
        try:
            self.RequestHandlerClass(tls, client_address, self)
        except (ssl.SSLError, OSError):
            pass
        finally:
            with self._open_lock:
                self._open.discard(tls)
            try:
                tls.close()
            except OSError:
                pass

    def close_streams(self) -> None:
        self.closing.set()
        with self._open_lock:
            socks = list(self._open)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    def _plain(self, code: int, text: str) -> None:
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        self._route()

    def do_POST(self) -> None:  # noqa: N802
        self._route()

    def _route(self) -> None:
        double = self.server.double
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
        parts = [urllib.parse.unquote(p) for p in url.path.strip("/").split("/")]
        double.requests.append((self.command, self.path))
        if len(parts) == 4 and parts[0] in ("containerLogs", "exec"):
            _, ns, pod, container = parts
            st = double.find(ns, pod)
            if st is None:
                return self._plain(404, f'pod "{pod}" in namespace "{ns}" is not known to this kubelet')
            names = [c["name"] for c in st.spec["containers"]]
            if container not in names:
                return self._plain(400, f'container "{container}" in pod "{pod}" is not valid')
            if st.script is None or st.running_at is None:
                reason = (st.script.waiting_reason if st.script else None) or "ContainerCreating"
                return self._plain(400, f'container "{container}" in pod "{pod}" is waiting to start: {reason}')
            if parts[0] == "exec" and st.finished_at is not None:
                return self._plain(400, f'container "{container}" in pod "{pod}" is not running')
            if parts[0] == "containerLogs" and self.command == "GET":
                return self._logs(st, container, query)
            if parts[0] == "exec":
                return self._exec(st, container, query)
        self._plain(404, f"not served by the kubelet double: {self.command} {url.path}")

    # -- logs --
    def _logs(self, st: PodState, container: str, q: dict[str, list[str]]) -> None:
        double = self.server.double
        if q.get("previous", ["false"])[0] == "true":
            return self._plain(400, f'previous terminated container "{container}" in pod "{st.name}" not found')
        data = double.log_bytes(st, container)
        lines = data.splitlines(keepends=True)
        since = q.get("sinceSeconds")
        if since and st.running_wall is not None and st.running_wall < time.time() - int(since[0]):
            lines = []  # every line carries the container's start time
        if "tailLines" in q:
            n = int(q["tailLines"][0])
            lines = lines[-n:] if n > 0 else []
        if q.get("timestamps", ["false"])[0] == "true":
            stamp = (_ts(st.running_wall or time.time(), nanos=True) + " ").encode()
            lines = [stamp + ln for ln in lines]
        out = b"".join(lines)
        if "limitBytes" in q:
            out = out[: int(q["limitBytes"][0])]
        follow = q.get("follow", ["false"])[0] == "true"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        if not follow:
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if out:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(out), out))
            self.wfile.flush()
        double.wait_container_end(st, self.server.closing)
        self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True

    # -- exec, over a websocket --
    def _exec(self, st: PodState, container: str, q: dict[str, list[str]]) -> None:
        argv = q.get("command", [])
        offered = [p.strip() for p in self.headers.get("Sec-WebSocket-Protocol", "").split(",")]
        proto = next((p for p in EXEC_PROTOCOLS if p in offered), None)
        if self.headers.get("Upgrade", "").lower() != "websocket" or proto is None:
            return self._plain(400, "the kubelet double serves exec over websockets "
                                    f"({', '.join(EXEC_PROTOCOLS)}) only; offered: {offered}")
        key = self.headers["Sec-WebSocket-Key"]
        accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        self.send_response(101, "Switching Protocols")
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.send_header("Sec-WebSocket-Protocol", proto)
        self.end_headers()
        self.wfile.flush()

        assert st.script is not None
        ans = st.script.container(container).answer(argv)
        if ans is not None and ans.then is not None:
            ans.then()  # the fault happens as this request arrives
        if ans is None:
            ans = Exec(stderr=f"kubelet double: no scripted answer for {argv!r} in {st.name}/{container}\n",
                       exit_code=127)
        time.sleep(EXEC_START_S)
        for ch, data in ((CH_STDOUT, ans.stdout), (CH_STDERR, ans.stderr)):
            raw = data.encode() if isinstance(data, str) else data
            if raw:
                self._frame(0x2, bytes([ch]) + raw)
        if ans.exit_code == 0:
            status: dict[str, Any] = {"metadata": {}, "status": "Success"}
        else:
            status = {"metadata": {}, "status": "Failure",
                      "message": f"command terminated with non-zero exit code: error executing command "
                                 f"{argv}, exit code {ans.exit_code}",
                      "reason": "NonZeroExitCode",
                      "details": {"causes": [{"reason": "ExitCode", "message": str(ans.exit_code)}]}}
        self._frame(0x2, bytes([CH_STATUS]) + json.dumps(status).encode())
        self._frame(0x8, struct.pack("!H", 1000))
        self._drain_until_close()
        self.close_connection = True

    def _frame(self, opcode: int, payload: bytes) -> None:
        n = len(payload)
        if n < 126:
            head = struct.pack("!BB", 0x80 | opcode, n)
        elif n < 1 << 16:
            head = struct.pack("!BBH", 0x80 | opcode, 126, n)
        else:
            head = struct.pack("!BBQ", 0x80 | opcode, 127, n)
        self.wfile.write(head + payload)
        self.wfile.flush()

    def _drain_until_close(self, timeout: float = 2.0) -> None:
        """Read the client's frames (stdin, resize, close) until its close frame or `timeout`."""
        self.connection.settimeout(timeout)
        try:
            while True:
                head = self.rfile.read(2)
                if len(head) < 2:
                    return
                opcode, n = head[0] & 0x0F, head[1] & 0x7F
                if n == 126:
                    n = struct.unpack("!H", self.rfile.read(2))[0]
                elif n == 127:
                    n = struct.unpack("!Q", self.rfile.read(8))[0]
                if head[1] & 0x80:
                    self.rfile.read(4)  # mask key; the payload is not needed
                self.rfile.read(n)
                if opcode == 0x8:
                    return
        except (OSError, struct.error):
            return


# ---- faults a node meets, made to happen by a test (appended behaviours) ----------------------
def _fault_pod(double: KubeletDouble, namespace: str, name: str) -> tuple[PodState, dict]:
    st = double.find(namespace, name)
    if st is None or st.script is None:
        raise RuntimeError(f"the kubelet double plays no scripted pod {namespace}/{name}")
    return st, double._api.get(f"/api/v1/namespaces/{namespace}/pods/{name}")


def end_now(double: KubeletDouble, namespace: str, name: str, *, exit_code: int, reason: str,
            restarted: bool = False) -> None:
    """The pod's containers end now with `exit_code` and the terminated `reason` the kubelet
    reads from the runtime (OOMKilled: the kernel's OOM killer, exit 137 = 128 + SIGKILL).
    restarted: as a pod with restartPolicy Always (a StatefulSet's) shows it next: Running,
    not Ready, the exit in lastState, restartCount 1, waiting CrashLoopBackOff (its
    message in the kubelet's "back-off 10s restarting failed container=... pod=..." form);
    else the pod ends Failed with the exit in state.terminated."""
    st, pod = _fault_pod(double, namespace, name)
    st.frozen, st.ready = True, False
    st.fault = {"exit_code": exit_code, "reason": reason, "restarted": restarted, "at": time.time()}
    if not restarted:
        st.finished_at, st.finished_wall, st.phase = time.monotonic(), time.time(), "Failed"
    double._patch(st, pod, "Running" if restarted else "Failed")


def evict(double: KubeletDouble, namespace: str, name: str, *, resource: str = "memory",
          usage: str, request: str) -> str:
    """The kubelet's eviction of the pod under node pressure: phase Failed, reason Evicted, the
    message in the eviction manager's form (pkg/kubelet/eviction: "The node was low on resource:
    memory. Container X was using 35505620Ki, which exceeds its request of 12Gi. ", as recorded
    in amygdala-labs/cosmos-operator#185 and kubernetes/kubernetes#112927), its containers
    killed (exit 137). Returns the message."""
    st, pod = _fault_pod(double, namespace, name)
    message = f"The node was low on resource: {resource}. " + "".join(
        f"Container {c['name']} was using {usage}, which exceeds its request of {request}. "
        for c in st.spec["containers"])
    st.frozen, st.ready = True, False
    st.finished_at, st.finished_wall, st.phase = time.monotonic(), time.time(), "Failed"
    st.fault = {"exit_code": 137, "reason": "Error", "pod_reason": "Evicted",
                "pod_message": message, "at": time.time()}
    double._patch(st, pod, "Failed")
    event(double, st, "Evicted", message)  # the eviction manager's own event
    return message


def event(double: KubeletDouble, st: PodState, reason: str, message: str) -> None:
    """A Warning event of the pod from the kubelet of its node (source component kubelet, host
    the node), as `kubectl get events` lists it: what remains of a pod its controller replaced."""
    now = _ts(time.time())
    double._api.post(f"/api/v1/namespaces/{st.namespace}/events", {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{st.name}.{_hex(st.uid, reason)[:16]}", "namespace": st.namespace},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": st.name,
                           "namespace": st.namespace, "uid": st.uid},
        "reason": reason, "message": message, "type": "Warning", "count": 1,
        "source": {"component": "kubelet", "host": st.node},
        "firstTimestamp": now, "lastTimestamp": now})


NODE_LOST_REASON = "NodeStatusUnknown"
NODE_LOST_MESSAGE = "Kubelet stopped posting node status."
UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"


def lose_node(double: KubeletDouble, node: str) -> None:
    """The node's kubelet stops posting status, and what the node lifecycle controller then
    writes (the plane runs without it: tests/kubeplane.py, --controllers=*,-nodelifecycle):
    every condition Unknown with reason NodeStatusUnknown, "Kubelet stopped posting node
    status." (kubernetes/kubernetes#36273), the unreachable taints NoSchedule and NoExecute
    (rancher/rancher#29997), and its pods' Ready condition False (the controller's
    MarkPodsNotReady); the pods stay bound and Running. Not modelled: the taint manager's
    eviction after the pods' tolerationSeconds (300 s by DefaultTolerationSeconds); and this
    double still finalizes a deleted pod of the lost node, which a real cluster leaves
    Terminating until the node answers or its Node object is deleted."""
    now = _ts(time.time())
    got = double._api.get(f"/api/v1/nodes/{node}")
    conditions = [{**c, "status": "Unknown", "reason": NODE_LOST_REASON,
                   "message": NODE_LOST_MESSAGE, "lastTransitionTime": now}
                  for c in (got.get("status") or {}).get("conditions") or []]
    double._api.patch(f"/api/v1/nodes/{node}/status", {"status": {"conditions": conditions}},
                      kind="strategic")
    double._api.patch(f"/api/v1/nodes/{node}", {"spec": {"taints": [
        {"key": UNREACHABLE_TAINT, "effect": effect, "timeAdded": now}
        for effect in ("NoSchedule", "NoExecute")]}}, kind="merge")
    with double._lock:
        lost = [st for st in double.pods.values() if st.node == node and st.script is not None
                and not st.gone and st.running_at is not None]
    for st in lost:
        st.frozen, st.ready = True, False
        pod = double._api.get(f"/api/v1/namespaces/{st.namespace}/pods/{st.name}")
        double._patch(st, pod, st.phase)


def restore_node(double: KubeletDouble, node: str) -> None:
    """The node back: Ready (the plane's helper), its taints gone."""
    double._api.patch(f"/api/v1/nodes/{node}", {"spec": {"taints": None}}, kind="merge")
    double.plane.set_node_ready(node, True)

