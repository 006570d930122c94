"""A real two-node Slurm on one host, as a test fixture (stdlib only; not a test file).

LocalSlurm starts, under a working directory of its own:

- munged, with its own key, socket, pid, seed and log file (never the system's munged, never
  /run/munge): Slurm reaches it through ``AuthInfo=socket=...`` in the generated slurm.conf,
  the command-line ``munge``/``unmunge`` through ``--socket`` (``LocalSlurm.munge_socket``);
- slurmctld, and one slurmd per node (``-N n1``, ``-N n2``, ...), all with ``-D`` (foreground)
  as children of this process, each in its own process group;
- a slurm.conf where every node is ``NodeHostname=localhost NodeAddr=127.0.0.1`` on a port of
  its own, and ``CommunicationParameters=NoCtldInAddrAny,NoInAddrAny`` keeps every listener on
  127.0.0.1.

Every daemon, and so every slurmstepd, job and task they start, and every client run through
``run()``, carries ``LOCALSLURM_ID=<id>`` in its environment: ``processes()`` finds them by it
in /proc, so ``stop()`` can prove nothing of the cluster is left.

How each daemon is found to be up (``start()``):

- munged: its socket exists and ``munge -n --socket S`` encodes a credential (exit 0);
- slurmctld: a listener on SlurmctldPort in /proc/net/tcp and ``scontrol ping`` says UP;
- slurmd: a listener on the node's Port, and ``sinfo`` shows the node idle (it registered with
  slurmctld and was accepted).

Install the packages with ``scripts/slurm-local.sh install`` (Debian slurm-wlm and munge).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

INSTALL_HINT = "scripts/slurm-local.sh install (Debian's slurm-wlm and munge)"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sinfo", "srun", "sbatch", "squeue", "scancel", "scontrol", "munge", "unmunge")
SBIN = "/usr/sbin:/sbin"
MARKER = "LOCALSLURM_ID"
# A unix socket path must fit sockaddr_un.sun_path (108 bytes); slurmd puts its steps' sockets
# under SlurmdSpoolDir as <node>_<job>.<step>, so the working directory must stay short.
MAX_WORKDIR_CHARS = 70


class LocalSlurmError(RuntimeError):
    """The local cluster did not come up, or did not go down cleanly."""


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":" + SBIN)


def missing_commands() -> list[str]:
    """The daemons and clients this fixture needs that are not installed."""
    return [c for c in DAEMONS + CLIENTS if _which(c) is None]


def installed() -> bool:
    return not missing_commands()


def slurm_version() -> str:
    """e.g. '22.05.8' (from ``slurmd -V``, which needs no slurm.conf)."""
    out = subprocess.run([_which("slurmd") or "slurmd", "-V"], capture_output=True, text=True)
    return out.stdout.split()[-1] if out.returncode == 0 and out.stdout.split() else ""


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held together while chosen, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def listening_ports() -> set[int]:
    """Ports with a TCP listener (any address, v4 or v6), from /proc/net/tcp{,6}."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A":  # TCP_LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def listeners() -> list[tuple[str, int]]:
    """(address, port) of every IPv4 TCP listener, from /proc/net/tcp."""
    out = []
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return out
    for line in lines:
        fields = line.split()
        if len(fields) > 3 and fields[3] == "0A":
            addr, port = fields[1].split(":")
            ip = ".".join(str(b) for b in reversed(bytes.fromhex(addr)))
            out.append((ip, int(port, 16)))
    return out


def _alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class LocalSlurm:
    """slurmctld + N slurmd + munged on one host, every file under one working directory.

    Use as ``with LocalSlurm().start(tmp) as cluster: cluster.run("sinfo")`` or call
    ``stop()`` yourself; ``stop()`` is idempotent.
    """

    def __init__(self, cluster_name: str = "localslurm") -> None:
        self.cluster_name = cluster_name
        self.id = secrets.token_hex(8)
        self.workdir: Path | None = None
        self.conf: Path | None = None
        self.munge_socket: Path | None = None
        self.nodes: list[str] = []
        self.cpus_per_node = 0
        self.ports: dict[str, int] = {}  # "slurmctld" and each node name
        self.procs: dict[str, subprocess.Popen] = {}  # "munged", "slurmctld", "slurmd-n1", ...
        self.pids: dict[str, int] = {}  # the same names: their PIDs, kept after stop()
        self.env: dict[str, str] = {}
        self.timings: dict[str, float] = {}  # seconds: "munged", "slurmctld", "idle" (from start)
        self.gres_gpus = 0
        self.conf_lines: tuple[str, ...] = ()  # the caller's slurm.conf lines (start())

    # ---------------------------------------------------------------- start

    def start(self, workdir: Path, nodes: int = 2, cpus_per_node: int | None = None,
              gres_gpus: int = 0, timeout: float = 60.0,
              conf_lines: tuple[str, ...] = ()) -> "LocalSlurm":
        """Write the configuration and start munged, slurmctld and one slurmd per node; return
        once ``sinfo`` shows every node idle (LocalSlurmError after ``timeout`` seconds, naming
        the last sinfo output and the daemons' log tails). ``gres_gpus`` > 0 declares
        ``Gres=gpu:<n>`` per node, each GPU a stand-in character device (root only: mknod).
        ``cpus_per_node`` defaults to min(2, this host's CPUs): every slurmd sees the whole
        host, and a node configured with more CPUs than that registers INVAL, unless slurmd
        takes the configured ones (SlurmdParameters=config_overrides, written when more are
        asked: a task per GPU of 8-GPU nodes needs 8 CPUs a node). ``conf_lines``: slurm.conf
        lines of the caller's (``Key=Value`` replacing this fixture's line of that key, e.g.
        ReturnToService=1; any other, e.g. a PartitionName=..., appended)."""
        if self.procs:
            raise LocalSlurmError("already started")
        self.pids, self.timings = {}, {}
        missing = missing_commands()
        if missing:
            raise LocalSlurmError(f"not installed: {', '.join(missing)}; run {INSTALL_HINT}")
        workdir = Path(workdir).resolve()
        if cpus_per_node is None:
            cpus_per_node = min(2, os.cpu_count() or 1)
        if len(str(workdir)) > MAX_WORKDIR_CHARS:
            raise LocalSlurmError(
                f"workdir {workdir} is longer than {MAX_WORKDIR_CHARS} characters: unix socket "
                "paths under it (munge, slurmstepd) would not fit in 108 bytes")
        self.workdir, self.cpus_per_node, self.gres_gpus = workdir, cpus_per_node, gres_gpus
        self.conf_lines = tuple(conf_lines)
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        for sub in ("munge", "state", "log", "run", *(f"spool/{n}" for n in self.nodes)):
            (workdir / sub).mkdir(parents=True, exist_ok=True)
        # munged wants its socket's folder executable by all and writable by its owner only
        os.chmod(workdir / "munge", 0o755)
        ports = free_ports(1 + nodes)
        self.ports = {"slurmctld": ports[0], **dict(zip(self.nodes, ports[1:]))}
        self.munge_socket = workdir / "munge" / "munge.socket"
        self.conf = workdir / "slurm.conf"
        self._write_conf()
        self.env = self._client_env()
        t0 = time.monotonic()
        deadline = t0 + timeout
        try:
            self._start_munged(deadline)
            self.timings["munged"] = time.monotonic() - t0
            self._start_slurmctld(deadline)
            self.timings["slurmctld"] = time.monotonic() - t0
            for node in self.nodes:
                self._spawn(f"slurmd-{node}", [_which("slurmd"), "-D", "-N", node,
                                               "-f", str(self.conf)])
            self._wait_idle(deadline)
            self.timings["idle"] = time.monotonic() - t0
        except BaseException:
            self.stop(check=False)
            raise
        return self

    def _write_conf(self) -> None:
        wd = self.workdir
        gres = self.gres_gpus > 0
        node_gres = f" Gres=gpu:{self.gres_gpus}" if gres else ""
        lines = [
            f"ClusterName={self.cluster_name}",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={self.ports['slurmctld']}",
            f"SlurmdPort={self.ports[self.nodes[0]]}",
            f"SlurmUser={_user()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny",
            f"StateSaveLocation={wd}/state",
            f"SlurmdSpoolDir={wd}/spool/%n",
            f"SlurmctldPidFile={wd}/run/slurmctld.pid",
            f"SlurmdPidFile={wd}/run/slurmd.%n.pid",
            f"SlurmctldLogFile={wd}/log/slurmctld.log",
            f"SlurmdLogFile={wd}/log/slurmd.%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            f"PlugStackConfig={wd}/plugstack.conf",  # not /etc/slurm's (pyxis and the like)
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "MinJobAge=2",
            "KillWait=2",
            "InactiveLimit=0",
            "MessageTimeout=10",
            "SlurmdTimeout=60",
            "SlurmctldTimeout=60",
        ]
        if self.cpus_per_node > (os.cpu_count() or 1):
            lines.append("SlurmdParameters=config_overrides")
        if gres:
            lines.append("GresTypes=gpu")
        for node in self.nodes:
            lines.append(
                f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 "
                f"Port={self.ports[node]} CPUs={self.cpus_per_node} RealMemory=1024"
                f"{node_gres} State=UNKNOWN")
        nodelist = ",".join(self.nodes)
        lines.append(f"PartitionName=test Nodes={nodelist} Default=YES MaxTime=INFINITE State=UP")
        lines = with_lines(lines, self.conf_lines)
        self.conf.write_text("\n".join(lines) + "\n")
        (wd / "plugstack.conf").write_text("")
        if gres:
            # Slurm 22.05 drops a GPU without File= ("Removing file-less GPU ... from final GRES
            # list") and the node then registers with fewer GPUs than configured (INVAL/DRAIN).
            # So each GPU gets a stand-in character device (that of /dev/null) under workdir.
            gpu_dir = wd / "gpu"
            gpu_dir.mkdir(exist_ok=True)
            for i in range(self.gres_gpus):
                dev = gpu_dir / f"nvidia{i}"
                if not dev.exists():
                    os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            files = f"{gpu_dir}/nvidia[0-{self.gres_gpus - 1}]"
            if self.gres_gpus == 1:
                files = f"{gpu_dir}/nvidia0"
            (wd / "gres.conf").write_text(
                f"AutoDetect=off\nNodeName={nodelist} Name=gpu File={files}\n")

    def _base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_"))}
        env["PATH"] = env.get("PATH", "/usr/bin:/bin") + ":" + SBIN
        env["SLURM_CONF"] = str(self.conf)
        env[MARKER] = self.id
        return env

    def _client_env(self) -> dict[str, str]:
        env = self._base_env()
        # munge/unmunge take --socket (libmunge reads no environment variable); Slurm's own
        # clients and daemons read the socket from AuthInfo in slurm.conf. Exported for scripts.
        env["MUNGE_SOCKET"] = str(self.munge_socket)
        return env

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.workdir / "log" / f"{name}.out", "ab")
        try:
            proc = subprocess.Popen(argv, env=self._client_env(), cwd=self.workdir,
                                    stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        self.procs[name] = proc
        self.pids[name] = proc.pid
        return proc

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise LocalSlurmError(
                    f"{name} exited with {proc.returncode} while starting\n{self.log_tails()}")

    def _start_munged(self, deadline: float) -> None:
        key = self.workdir / "munge" / "munge.key"
        if not key.exists():
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(1024))
        d = self.workdir / "munge"
        # --force: munged refuses a socket whose ancestor folders are not executable by all
        # (pytest's tmp folders are 0700); with it that is a warning. Every daemon and client
        # of this cluster runs as this same user, who can reach the socket.
        self._spawn("munged", [
            _which("munged"), "-F", "--force", f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed",
            f"--log-file={self.workdir}/log/munged.log", "--num-threads=2"])
        munge = _which("munge")
        while True:
            self._check_alive()
            if self.munge_socket.exists():
                r = subprocess.run([munge, "-n", f"--socket={self.munge_socket}"],
                                   capture_output=True, env=self.env)
                if r.returncode == 0:
                    return
            if time.monotonic() > deadline:
                raise LocalSlurmError(f"munged not up (munge -n fails)\n{self.log_tails()}")
            time.sleep(0.1)

    def _start_slurmctld(self, deadline: float) -> None:
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        port = self.ports["slurmctld"]
        last = ""
        while True:
            self._check_alive()
            if port in listening_ports():
                r = self.run("scontrol", "ping", check=False, timeout=10)
                last = (r.stdout + r.stderr).strip()
                if "UP" in r.stdout:
                    return
            if time.monotonic() > deadline:
                raise LocalSlurmError(
                    f"slurmctld not up on port {port}; last `scontrol ping`: {last!r}\n"
                    f"{self.log_tails()}")
            time.sleep(0.2)

    def node_states(self) -> dict[str, str]:
        """{node: state} from ``sinfo -N``, e.g. {'n1': 'idle', 'n2': 'alloc'}."""
        r = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        states = {}
        for line in r.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1]
        return states

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until every node is idle in ``sinfo`` (no job, nothing completing)."""
        self._wait_idle(time.monotonic() + timeout)

    def _wait_idle(self, deadline: float) -> None:
        while True:
            self._check_alive()
            up = listening_ports()
            closed = [n for n in self.nodes if self.ports[n] not in up]
            r = self.run("sinfo", "-N", "-o", "%N %T %E", check=False)
            states = {}
            for line in r.stdout.splitlines()[1:]:
                parts = line.split()
                if len(parts) >= 2:
                    states[parts[0]] = parts[1]
            if not closed and all(states.get(n) == "idle" for n in self.nodes):
                return
            if time.monotonic() > deadline:
                raise LocalSlurmError(
                    f"nodes {self.nodes} not idle in time (slurmd ports not listening: "
                    f"{closed or 'none'}); last `sinfo -N`:\n"
                    f"{(r.stdout + r.stderr).strip()}\n{self.log_tails()}")
            time.sleep(0.2)

    # ---------------------------------------------------------------- use

    def run(self, *argv: str, check: bool = True, timeout: float = 60.0,
            input: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
        """Run a Slurm client (sinfo, srun, sbatch, squeue, scancel, scontrol, ...) against this
        cluster; text output captured. ``check`` raises LocalSlurmError on a non-zero exit."""
        if not self.env:
            raise LocalSlurmError("not started")
        argv = [str(a) for a in argv]
        exe = _which(argv[0]) or argv[0]
        r = subprocess.run([exe, *argv[1:]], env=self.env, capture_output=True, text=True,
                           timeout=timeout, input=input, cwd=cwd or self.workdir)
        if check and r.returncode != 0:
            raise LocalSlurmError(
                f"{' '.join(argv)} exited {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}")
        return r

    def sbatch(self, script: str, *options: str) -> int:
        """Submit a batch script (text); return its job id."""
        path = self.workdir / f"job-{secrets.token_hex(4)}.sh"
        path.write_text(script)
        r = self.run("sbatch", "--parsable", *options, str(path))
        return int(r.stdout.strip().split(";")[0])

    def queue(self) -> list[str]:
        """Job ids in squeue (any state squeue still shows)."""
        r = self.run("squeue", "-h", "-o", "%i")
        return r.stdout.split()

    def job_state(self, jobid: int | str) -> str:
        """State from ``scontrol show job`` ('' once slurmctld has forgotten the job)."""
        r = self.run("scontrol", "-o", "show", "job", str(jobid), check=False)
        m = re.search(r"\bJobState=(\S+)", r.stdout)
        return m.group(1) if m else ""

    def wait_gone(self, jobid: int | str, timeout: float = 30.0) -> None:
        """Wait until ``squeue`` no longer shows the job."""
        deadline = time.monotonic() + timeout
        while str(jobid) in self.queue():
            if time.monotonic() > deadline:
                raise LocalSlurmError(f"job {jobid} still in squeue after {timeout} s: "
                                      f"{self.run('squeue', check=False).stdout}")
            time.sleep(0.2)

    def wait_running(self, jobid: int | str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while (state := self.job_state(jobid)) != "RUNNING":
            if time.monotonic() > deadline:
                raise LocalSlurmError(f"job {jobid} not RUNNING after {timeout} s: {state}")
            time.sleep(0.2)

    def show_node(self, node: str) -> dict[str, str]:
        """``scontrol -o show node NODE`` parsed into {key: value}."""
        r = self.run("scontrol", "-o", "show", "node", node)
        return parse_scontrol(r.stdout)

    def job_pids(self, jobid: int | str) -> list[int]:
        """PIDs of the job's processes on every node (``scontrol listpids JOBID NODE``)."""
        pids = []
        for node in self.nodes:
            r = self.run("scontrol", "listpids", str(jobid), node, check=False)
            for line in r.stdout.splitlines()[1:]:
                fields = line.split()
                if fields and fields[0].isdigit():
                    pids.append(int(fields[0]))
        return pids

    def processes(self) -> list[int]:
        """Every live process of this cluster (daemons, slurmstepd, jobs), found in /proc by
        the LOCALSLURM_ID in its environment, plus the daemons by PID."""
        me = os.getpid()
        needle = f"{MARKER}={self.id}".encode()
        found = {p.pid for p in self.procs.values() if _alive(p.pid)}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) == me:
                continue
            try:
                environ = Path(entry.path, "environ").read_bytes()
            except OSError:
                continue
            if needle in environ.split(b"\0") and _alive(int(entry.name)):
                found.add(int(entry.name))
        return sorted(found)

    def open_ports(self) -> list[int]:
        """This cluster's ports that still have a listener."""
        up = listening_ports()
        return [p for p in self.ports.values() if p in up]

    def log_tails(self, lines: int = 15) -> str:
        if self.workdir is None:
            return ""
        out = []
        for path in sorted((self.workdir / "log").glob("*")):
            try:
                text = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            if text:
                out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out)

    # ---------------------------------------------------------------- stop

    def stop(self, timeout: float = 15.0, check: bool = True) -> None:
        """Cancel every job of the cluster, stop every daemon started (TERM, then KILL after
        ``timeout``/2 s), then any process of the cluster still found by its environment;
        with ``check``, raise LocalSlurmError if a process or a listener on its ports is
        left."""
        if not self.procs:
            return
        ctld = self.procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None and self.env:
            try:
                # every job this slurmctld knows is this cluster's (whatever its user)
                jobs = self.queue()
                if jobs:
                    self.run("scancel", *jobs, check=False, timeout=10)
                deadline = time.monotonic() + timeout / 2
                while self.queue() and time.monotonic() < deadline:
                    time.sleep(0.2)
            except (subprocess.TimeoutExpired, LocalSlurmError):
                pass
        # slurmd first (it ends its steps), then slurmctld, then munged they all use.
        order = ([n for n in self.procs if n.startswith("slurmd-")]
                 + [n for n in ("slurmctld", "munged") if n in self.procs])
        for name in order:
            _terminate(self.procs[name], timeout / 2)
        for pid in self.processes():  # a slurmstepd or task that outlived its slurmd
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout / 2
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        ports = self.open_ports()
        while ports and time.monotonic() < deadline:
            time.sleep(0.1)
            ports = self.open_ports()
        self.procs = {}
        if check and (left or ports):
            raise LocalSlurmError(f"left after stop: processes {left}, listening ports {ports}")

    def __enter__(self) -> "LocalSlurm":
        return self

    def __exit__(self, *exc) -> None:
        self.stop(check=exc[0] is None)


def _terminate(proc: subprocess.Popen, grace: float) -> None:
    """TERM the daemon's process group, wait ``grace`` s, then KILL it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything left in its group
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def parse_scontrol(text: str) -> dict[str, str]:
    """'Key=Value Key2=Value2 ...' (one-line ``scontrol -o`` output) into a dict; values may
    hold spaces only in the last keys scontrol prints (Reason=...), kept whole."""
    out: dict[str, str] = {}
    for m in re.finditer(r"(\S+?)=(.*?)(?=\s+\S+?=|\s*$)", text.strip()):
        out[m.group(1)] = m.group(2)
    return out


def with_lines(lines: list[str], extra: tuple[str, ...]) -> list[str]:
    """slurm.conf `lines` with `extra`'s: a one-key line (``Key=Value``) replaces the line of
    that key, every other is appended (Slurm reads one value per key; a second one would be
    a duplicate, not an override)."""
    out = list(lines)
    for line in extra:
        key, sep, value = line.partition("=")
        at = [i for i, old in enumerate(out) if old.startswith(key + "=")]
        if sep and " " not in value and at and key != "PartitionName" and key != "NodeName":
            out[at[0]] = line
        else:
            out.append(line)
    return out
