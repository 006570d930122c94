"""A real Kubernetes 1.20.2 control plane on 127.0.0.1, for tests (not a test file).

etcd, kube-apiserver, kube-controller-manager and kube-scheduler are the real programs, built from
Debian's source package by ``scripts/kube-plane.sh build`` into a cache outside the repository
(reference/TOOLCHAIN.md). Only kubelets are missing: nodes are API objects, and
tests/kubelet_double.py plays the kubelet for them (pod status, logs, exec).

    from kubeplane import KubePlane, plane_available   # tests/ is on sys.path under pytest
    plane = KubePlane().start(tmp_path)        # certificates, token, kubeconfig, four processes
    plane.add_node("p5en-0", kubelet_port=double.port)
    plane.kubectl("get", "nodes")              # the real kubectl with the plane's kubeconfig
    plane.stop()                               # every process and listener gone

Every listener is on 127.0.0.1; insecure ports are off; each process runs in its own process
group and is stopped by that group (TERM, then KILL). Stdlib and PyYAML only.
"""
from __future__ import annotations

import atexit
import http.client
import json
import os
import secrets
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / "scripts" / "kube-plane.sh"
KUBE_VERSION = "1.20.2"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
CONTEXT = "guide-test"
NOT_BUILT = "kube control plane not built: run scripts/kube-plane.sh build"
SERVICE_CIDR = "10.96.0.0/16"
EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256")  # TLS keys: fast to make


class PlaneError(RuntimeError):
    """The control plane could not be started, or an API call failed."""


class ApiError(PlaneError):
    def __init__(self, method: str, path: str, status: int, body: str):
        self.method, self.path, self.status, self.body = method, path, status, body
        super().__init__(f"{method} {path}: HTTP {status}: {body[:500]}")


# ---- where the binaries are ------------------------------------------------------------------
def cache_dir() -> Path:
    """The build cache, as scripts/kube-plane.sh computes it."""
    default = Path.home() / ".cache" / "deepep-guide" / f"kube-{KUBE_VERSION}"
    return Path(os.environ.get("KUBE_PLANE_CACHE") or default)


def bin_dir() -> Path:
    return cache_dir() / "bin"


def missing_binaries(bindir: Path | None = None) -> list[str]:
    bindir = bindir or bin_dir()
    return [c for c in COMPONENTS if not os.access(bindir / c, os.X_OK)]


def plane_available(bindir: Path | None = None) -> bool:
    """Whether the cached binaries exist (a cheap check: nothing is run)."""
    return not missing_binaries(bindir)


def plane_unavailable_reason(bindir: Path | None = None) -> str | None:
    """None when the plane can start; otherwise the reason to show when skipping or failing."""
    missing = missing_binaries(bindir)
    if not missing:
        return None
    return f"{NOT_BUILT} (missing in {bindir or bin_dir()}: {', '.join(missing)})"


# ---- small helpers ---------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_until(what: str, probe: Callable[[], tuple[bool, Any]], timeout: float,
               interval: float = 0.1) -> Any:
    """Call probe() -> (done, answer) until done; return the answer. At the deadline raise
    PlaneError naming `what` and the last answer (an exception probe raised counts as one)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            done, last = probe()
            if done:
                return last
        except PlaneError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported below
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise PlaneError(f"timed out after {timeout:g} s waiting for {what}; last answer: {last!r}")
        time.sleep(interval)


def openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if proc.returncode:
        raise PlaneError(f"openssl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")


def make_serving_cert(workdir: Path, name: str, ca: tuple[Path, Path] | None = None,
                      sans: str = "IP:127.0.0.1,DNS:localhost") -> tuple[Path, Path]:
    """An RSA key and certificate for 127.0.0.1: signed by `ca` (crt, key), else self-signed."""
    key, crt = workdir / f"{name}.key", workdir / f"{name}.crt"
    ext = workdir / f"{name}.ext"
    ext.write_text(f"subjectAltName={sans}\nbasicConstraints=critical,CA:FALSE\n"
                   "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")
    if ca is None:
        openssl("req", "-x509", *EC_KEY, "-nodes", "-keyout", key.name, "-out", crt.name,
                "-days", "7", "-subj", f"/CN={name}", "-addext", f"subjectAltName={sans}", cwd=workdir)
    else:
        openssl("req", "-new", *EC_KEY, "-nodes", "-keyout", key.name,
                "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=workdir)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(ca[0]), "-CAkey", str(ca[1]),
                "-CAcreateserial", "-out", crt.name, "-days", "7", "-extfile", ext.name, cwd=workdir)
    return crt, key


# ---- the API, with the token -----------------------------------------------------------------
class Api:
    """A minimal client for the API server: bearer token, the plane's CA, JSON in and out.

    One keep-alive connection per thread; safe to share between threads."""

    def __init__(self, server: str, token: str, ca_file: Path, timeout: float = 30.0):
        url = urllib.parse.urlsplit(server)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 443
        self.token, self.timeout = token, timeout
        self.ctx = ssl.create_default_context(cafile=str(ca_file))
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPSConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=self.timeout)
            self._local.conn = conn
        return conn

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json", ok: Iterable[int] = ()) -> tuple[int, Any]:
        """(status, decoded JSON or text). Raises ApiError for a status >= 400 not in `ok`."""
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        for attempt in (0, 1):
            conn = self._conn()
            try:
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
                break
            except (http.client.HTTPException, OSError):
                self.close()  # a stale keep-alive connection: retry once on a fresh one
                if attempt:
                    raise
        text = raw.decode("utf-8", "replace")
        try:
            payload: Any = json.loads(text) if text else None
        except ValueError:
            payload = text
        if resp.status >= 400 and resp.status not in ok:
            raise ApiError(method, path, resp.status, text)
        return resp.status, payload

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)[1]

    def post(self, path: str, body: Any, **kw: Any) -> Any:
        return self.request("POST", path, body, **kw)[1]

    def patch(self, path: str, body: Any, kind: str = "merge", **kw: Any) -> Any:
        ctype = {"merge": "application/merge-patch+json",
                 "strategic": "application/strategic-merge-patch+json",
                 "json": "application/json-patch+json"}[kind]
        return self.request("PATCH", path, body, content_type=ctype, **kw)[1]

    def delete(self, path: str, body: Any = None, **kw: Any) -> Any:
        return self.request("DELETE", path, body, **kw)[1]


# ---- the plane -------------------------------------------------------------------------------
@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    logfile: Any = field(repr=False, default=None)


class KubePlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on 127.0.0.1.

    Attributes after start(): workdir, kubeconfig, server, token, ca_file, ports (name -> port),
    pids (name -> pid), api (an Api), started_in (seconds start() took)."""

    def __init__(self, bindir: Path | None = None, kubectl_bin: str = "kubectl",
                 ready_timeout: float = 90.0):
        self.bindir = Path(bindir) if bindir else bin_dir()
        self.kubectl_bin = kubectl_bin
        self.ready_timeout = ready_timeout
        self.procs: list[_Proc] = []
        self.ports: dict[str, int] = {}
        self.workdir: Path | None = None
        self.kubeconfig: Path | None = None
        self.server = ""
        self.token = ""
        self.ca_file: Path | None = None
        self.api: Api | None = None
        self.started_in: float | None = None
        self._atexit = False

    # -- lifecycle --
    @property
    def pids(self) -> dict[str, int]:
        return {p.name: p.popen.pid for p in self.procs}

    def __enter__(self) -> "KubePlane":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self, workdir: Path) -> "KubePlane":
        """Certificates, token, kubeconfig, then the four processes; returns when /readyz is ok
        and the default service account of `default` has its token (pods can be created)."""
        reason = plane_unavailable_reason(self.bindir)
        if reason:
            raise PlaneError(reason)
        if self.procs:
            raise PlaneError("this KubePlane is already started")
        t0 = time.monotonic()
        self.workdir = wd = Path(workdir).resolve()
        wd.mkdir(parents=True, exist_ok=True)
        if not self._atexit:
            atexit.register(self.stop)
            self._atexit = True
        try:
            sa_key = self._start_sa_key(wd)  # RSA takes up to a second: made meanwhile
            self._make_credentials(wd)
            self._start_etcd(wd)
            self._finish_sa_key(wd, sa_key)
            self._start_apiserver(wd)
            self._start_controllers(wd)
            self._wait_default_serviceaccount("default")
        except BaseException:
            self.stop()
            raise
        self.started_in = time.monotonic() - t0
        return self

    def _start_sa_key(self, wd: Path) -> subprocess.Popen:
        """The service-account RSA key pair, begun in the background."""
        (wd / "pki").mkdir(parents=True, exist_ok=True)
        return subprocess.Popen(["openssl", "genrsa", "-out", "sa.key", "2048"], cwd=wd / "pki",
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def _finish_sa_key(self, wd: Path, proc: subprocess.Popen) -> None:
        _, err = proc.communicate(timeout=60)
        if proc.returncode:
            raise PlaneError(f"openssl genrsa failed ({proc.returncode}): {err.decode().strip()}")
        pki = wd / "pki"
        openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
        (pki / "sa.key").chmod(0o600)

    def _make_credentials(self, wd: Path) -> None:
        pki = wd / "pki"
        pki.mkdir(exist_ok=True)
        openssl("req", "-x509", *EC_KEY, "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
                "-days", "7", "-subj", "/CN=guide-test-ca",
                "-addext", "basicConstraints=critical,CA:TRUE",
                "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature", cwd=pki)
        self.ca_file = pki / "ca.crt"
        sans = ("IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
                "DNS:kubernetes.default.svc")
        make_serving_cert(pki, "apiserver", ca=(pki / "ca.crt", pki / "ca.key"), sans=sans)
        self.token = secrets.token_hex(24)
        tokens = pki / "tokens.csv"
        tokens.write_text(f'{self.token},guide-admin,guide-admin,"system:masters"\n')
        for f in (pki / "ca.key", pki / "apiserver.key", tokens):
            f.chmod(0o600)

        for name in ("etcd", "etcd-peer", "kube-apiserver"):
            self.ports[name] = free_port()
        self.server = f"https://127.0.0.1:{self.ports['kube-apiserver']}"
        self.kubeconfig = wd / "kubeconfig"
        config = {
            "apiVersion": "v1", "kind": "Config", "preferences": {},
            "clusters": [{"name": CONTEXT, "cluster": {"server": self.server,
                                                       "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": CONTEXT, "user": {"token": self.token}}],
            "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": CONTEXT,
                                                      "namespace": "default"}}],
            "current-context": CONTEXT,
        }
        self.kubeconfig.write_text(yaml.safe_dump(config, sort_keys=False))
        self.kubeconfig.chmod(0o600)
        self.api = Api(self.server, self.token, self.ca_file)

    def _spawn(self, name: str, argv: list[str]) -> _Proc:
        assert self.workdir is not None
        log = self.workdir / f"{name}.log"
        logfile = open(log, "ab")  # noqa: SIM115 - closed in stop()
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logfile, stderr=subprocess.STDOUT,
                                 cwd=self.workdir, start_new_session=True)  # its own process group
        proc = _Proc(name, popen, log, logfile)
        self.procs.append(proc)
        return proc

    def _check_alive(self, proc: _Proc) -> None:
        if proc.popen.poll() is not None:
            tail = proc.log.read_text(errors="replace").splitlines()[-15:]
            raise PlaneError(f"{proc.name} exited with {proc.popen.returncode}; log {proc.log}:\n"
                             + "\n".join(tail))

    def _start_etcd(self, wd: Path) -> None:
        client, peer = self.ports["etcd"], self.ports["etcd-peer"]
        proc = self._spawn("etcd", [
            str(self.bindir / "etcd"), "--name=guide-test", f"--data-dir={wd / 'etcd-data'}",
            f"--listen-client-urls=http://127.0.0.1:{client}",
            f"--advertise-client-urls=http://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=guide-test=http://127.0.0.1:{peer}",
            "--initial-cluster-state=new", "--log-level=warn", "--quota-backend-bytes=1073741824",
        ])

        def healthy() -> Any:
            self._check_alive(proc)
            conn = http.client.HTTPConnection("127.0.0.1", client, timeout=2)
            try:
                conn.request("GET", "/health")
                body = conn.getresponse().read().decode()
            finally:
                conn.close()
            return '"health":"true"' in body.replace(" ", ""), body

        wait_until(f"etcd /health on 127.0.0.1:{client}", healthy, self.ready_timeout)

    def _start_apiserver(self, wd: Path, extra_flags: Iterable[str] = ()) -> None:
        pki = wd / "pki"
        proc = self._spawn("kube-apiserver", [
            str(self.bindir / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={self.ports['kube-apiserver']}", "--insecure-port=0",
            f"--cert-dir={pki}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}", f"--token-auth-file={pki / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            "--disable-admission-plugins=TaintNodesByCondition",
            "--kubelet-preferred-address-types=InternalIP",
            "--profiling=false", "--v=1", *extra_flags,
        ])
        assert self.api is not None
        api = self.api

        def ready() -> Any:
            self._check_alive(proc)
            status, body = api.request("GET", "/readyz", ok=range(400, 600))
            return status == 200 and body == "ok", f"HTTP {status}: {body}"

        try:
            wait_until(f"kube-apiserver {self.server}/readyz to answer 200 ok", ready,
                       self.ready_timeout, interval=0.2)
        finally:
            api.close()

    def _controller_kubeconfig(self) -> Path:
        return self.kubeconfig  # type: ignore[return-value]  # system:masters token, local CA

    def _start_controllers(self, wd: Path) -> None:
        pki = wd / "pki"
        kc = str(self._controller_kubeconfig())
        self._spawn("kube-controller-manager", [
            str(self.bindir / "kube-controller-manager"), f"--kubeconfig={kc}",
            "--leader-elect=false", "--port=0", "--secure-port=0",
            f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
            "--use-service-account-credentials=false",
            "--controllers=*,-nodelifecycle", f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--concurrent-statefulset-syncs=5", "--profiling=false", "--v=1",
        ])
        self._spawn("kube-scheduler", [
            str(self.bindir / "kube-scheduler"), f"--kubeconfig={kc}",
            "--leader-elect=false", "--port=0", "--secure-port=0", "--profiling=false", "--v=1",
        ])

    def _wait_default_serviceaccount(self, namespace: str) -> None:
        """Pods are refused until the namespace's default service account has its token secret."""
        assert self.api is not None
        api = self.api

        def has_token() -> Any:
            for p in self.procs:
                self._check_alive(p)
            status, sa = api.request("GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/default",
                                     ok=(404,))
            return status == 200 and bool(sa.get("secrets")), f"HTTP {status}: {sa}"

        try:
            wait_until(f"the service account {namespace}/default and its token (kube-controller-manager)",
                       has_token, self.ready_timeout, interval=0.2)
        finally:
            api.close()

    def create_namespace(self, name: str) -> None:
        """A namespace, ready for pods (its default service account has a token)."""
        assert self.api is not None
        self.api.request("POST", "/api/v1/namespaces",
                         {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}, ok=(409,))
        self._wait_default_serviceaccount(name)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every process group started here, newest first (scheduler and controllers, then
        the API server while etcd still answers, then etcd): TERM, wait up to `timeout`, KILL.
        Idempotent. (TERMed while etcd is already gone, kube-apiserver 1.20 hangs on shutdown.)"""
        procs, self.procs = list(reversed(self.procs)), []
        if self.api is not None:
            self.api.close()
        # the two clients of the API server together, then the API server, then etcd
        stages = [[p for p in procs if p.name in ("kube-scheduler", "kube-controller-manager")],
                  [p for p in procs if p.name not in ("kube-scheduler", "kube-controller-manager", "etcd")],
                  [p for p in procs if p.name == "etcd"]]
        for stage in stages:
            for p in stage:
                _signal_group(p.popen.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for p in stage:
                try:
                    p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                _signal_group(p.popen.pid, signal.SIGKILL)  # what is left of the group
                try:
                    p.popen.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
                if p.logfile:
                    p.logfile.close()

    def stop_apiserver(self, timeout: float = 2.0) -> float:
        """Stop the API server alone (TERM, then KILL after `timeout`), etcd, the controllers and
        the scheduler left running (they reconnect when it is back): kubectl then says "The
        connection to the server ... was refused". Returns the seconds it took. (Measured: TERMed
        with its clients connected, 1.20's kube-apiserver had not exited after 10 s; it is
        KILLed after 2 s, as a crash would end it. Started again, /readyz answers in ~5 s.)"""
        t0 = time.monotonic()
        procs = [p for p in self.procs if p.name == "kube-apiserver"]
        if not procs:
            raise PlaneError("no kube-apiserver is running")
        for p in procs:
            self.procs.remove(p)
            _signal_group(p.popen.pid, signal.SIGTERM)
            try:
                p.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _signal_group(p.popen.pid, signal.SIGKILL)
                p.popen.wait(timeout=5)
            if p.logfile:
                p.logfile.close()
        if self.api is not None:
            self.api.close()
        wait_until(f"the API server's port {self.ports['kube-apiserver']} closed",
                   lambda: (not port_open(self.ports["kube-apiserver"]), None), timeout)
        return time.monotonic() - t0

    def start_apiserver(self, extra_flags: Iterable[str] = ()) -> float:
        """Start the API server again on its port, with its certificates and token (and
        `extra_flags`, e.g. --enable-admission-plugins=PodSecurityPolicy); returns when /readyz
        is ok: the seconds it took."""
        assert self.workdir is not None, "the plane is not started"
        t0 = time.monotonic()
        self._start_apiserver(self.workdir, extra_flags)
        return time.monotonic() - t0

    def restart_apiserver(self, down_s: float = 0.0, extra_flags: Iterable[str] = ()) -> dict:
        """Stop the API server, keep it down `down_s`, start it again: the seconds of each."""
        stopped = self.stop_apiserver()
        time.sleep(down_s)
        return {"stop_s": stopped, "down_s": down_s, "start_s": self.start_apiserver(extra_flags)}

    def is_running(self) -> bool:
        return bool(self.procs) and all(p.popen.poll() is None for p in self.procs)

    # -- using it --
    def env(self) -> dict[str, str]:
        """The environment for running kubectl (or anything reading KUBECONFIG) against the plane."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        return env

    def kubectl(self, *args: str, input: str | bytes | None = None, check: bool = True,
                timeout: float = 60.0, text: bool = True) -> subprocess.CompletedProcess:
        """Run the real kubectl with the plane's kubeconfig (and --context guide-test).

        check=True raises PlaneError with stderr on a non-zero exit; text=False gives bytes."""
        if self.kubeconfig is None:
            raise PlaneError("the plane is not started")
        if text and isinstance(input, bytes):
            input = input.decode()
        argv = [self.kubectl_bin, f"--kubeconfig={self.kubeconfig}", f"--context={CONTEXT}", *args]
        proc = subprocess.run(argv, input=input, capture_output=True, text=text, timeout=timeout,
                              env=self.env())
        if check and proc.returncode:
            err = proc.stderr if text else proc.stderr.decode(errors="replace")
            raise PlaneError(f"{' '.join(argv[3:])!r} exited {proc.returncode}: {err.strip()}")
        return proc

    def apply(self, *objs: dict | str, extra: Iterable[str] = ()) -> subprocess.CompletedProcess:
        """kubectl apply -f - with objects (dicts, dumped with PyYAML) or YAML text."""
        docs = [o if isinstance(o, str) else yaml.safe_dump(o, sort_keys=False) for o in objs]
        return self.kubectl("apply", *extra, "-f", "-", input="\n---\n".join(docs))

    def get_json(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def register_crd(self, path: Path, timeout: float = 60.0) -> dict:
        """kubectl apply a CustomResourceDefinition (YAML at `path`), then wait until the API
        server says it is Established (its objects are then validated and stored) and serves
        its resource in discovery. Returns the CRD as the API server answers."""
        assert self.api is not None, "the plane is not started"
        crd = yaml.safe_load(Path(path).read_text())
        self.apply(crd)
        name = crd["metadata"]["name"]
        group = crd["spec"]["group"]
        version = next(v["name"] for v in crd["spec"]["versions"] if v.get("served"))
        plural = crd["spec"]["names"]["plural"]
        api = self.api

        def established() -> Any:
            got = api.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
            conditions = {c["type"]: c["status"] for c in got.get("status", {}).get("conditions", [])}
            if conditions.get("Established") != "True":
                return False, conditions
            status, listed = api.request("GET", f"/apis/{group}/{version}", ok=(404, 503))
            served = status == 200 and any(r["name"] == plural for r in listed.get("resources", []))
            return served, (conditions, status)

        try:
            wait_until(f"the CRD {name} Established and in discovery", established, timeout,
                       interval=0.2)
            return api.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        finally:
            api.close()

    def add_node(self, name: str, instance_type: str = "p5en.48xlarge", gpus: int = 8, efa: int = 16,
                 hugepages_2mi: str = "5120Mi", cpu: str = "192", memory: str = "2000Gi",
                 pods: int = 110, kubelet_port: int = 10250, labels: dict[str, str] | None = None,
                 ready: bool = True) -> dict:
        """Create a Node with the p5en's capacity (and allocatable), then patch its status Ready
        with InternalIP 127.0.0.1 and daemonEndpoints.kubeletEndpoint.Port = kubelet_port.
        Returns the Node as the API server answers."""
        assert self.api is not None, "the plane is not started"
        resources = {"nvidia.com/gpu": str(gpus), "vpc.amazonaws.com/efa": str(efa),
                     "hugepages-2Mi": hugepages_2mi, "cpu": cpu, "memory": memory, "pods": str(pods)}
        node_labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                       "kubernetes.io/arch": "amd64", "node.kubernetes.io/instance-type": instance_type,
                       **(labels or {})}
        status = {
            "capacity": resources, "allocatable": resources,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                          {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
            "nodeInfo": {"kubeletVersion": f"v{KUBE_VERSION}", "kubeProxyVersion": f"v{KUBE_VERSION}",
                         "operatingSystem": "linux", "architecture": "amd64",
                         "containerRuntimeVersion": "containerd://kubelet-double", "osImage": "test",
                         "kernelVersion": "", "machineID": "", "systemUUID": "", "bootID": ""},
        }
        self.api.post("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                        "metadata": {"name": name, "labels": node_labels},
                                        "status": status})
        return self.set_node_ready(name, ready, extra_status=status)

    def set_node_ready(self, name: str, ready: bool = True, extra_status: dict | None = None) -> dict:
        assert self.api is not None
        now = _rfc3339(time.time())
        cond = {"type": "Ready", "status": "True" if ready else "False",
                "reason": "KubeletReady" if ready else "KubeletNotReady",
                "message": "kubelet double is posting ready status" if ready else "set not ready by the test",
                "lastHeartbeatTime": now, "lastTransitionTime": now}
        body = {"status": {**(extra_status or {}), "conditions": [cond]}}
        return self.api.patch(f"/api/v1/nodes/{name}/status", body, kind="strategic")


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


# ---- a pytest fixture for conftest.py --------------------------------------------------------
try:
    import pytest
except ImportError:  # the module stays importable without pytest
    pytest = None  # type: ignore[assignment]

if pytest is not None:
    @pytest.fixture(scope="session")
    def kube_plane(tmp_path_factory: Any) -> Any:
        """A started KubePlane for the session (no nodes). FAILS, naming the build command, when
        the binaries are missing: `make test` builds them first. Import it in conftest.py:
        ``from kubeplane import kube_plane  # noqa: F401``."""
        reason = plane_unavailable_reason()
        if reason:
            pytest.fail(reason, pytrace=False)
        plane = KubePlane().start(tmp_path_factory.mktemp("kube-plane"))
        try:
            yield plane
        finally:
            plane.stop()
