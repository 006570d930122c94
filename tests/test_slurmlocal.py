"""A real two-node Slurm on one host (tests/slurmlocal.py): scheduling, steps, cancel, and a
rendezvous across the two nodes, as the guide's multi-node launches need them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

try:
    import slurmlocal
except ImportError:  # tests/ imported as a package
    from tests import slurmlocal

pytestmark = pytest.mark.skipif(
    not slurmlocal.installed(),
    reason=(f"slurm-wlm/munge not installed (missing: {', '.join(slurmlocal.missing_commands())})"
            f"; install with {slurmlocal.INSTALL_HINT}"),
)

# Stand-in GPUs need mknod (root); without it the cluster runs without GRES.
GPUS = 2 if os.geteuid() == 0 else 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = slurmlocal.LocalSlurm()
    c.start(tmp_path_factory.mktemp("slurm"), nodes=2, gres_gpus=GPUS)
    yield c
    c.stop()


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_two_nodes_idle(cluster):
    assert cluster.node_states() == {"n1": "idle", "n2": "idle"}
    out = cluster.run("sinfo", "-h", "-o", "%P %a %D %T %N").stdout.split()
    assert out == ["test*", "up", "2", "idle", "n[1-2]"]
    # every listener of the cluster is on 127.0.0.1
    mine = set(cluster.ports.values())
    assert {a for a, p in slurmlocal.listeners() if p in mine} == {"127.0.0.1"}
    assert sorted(p for a, p in slurmlocal.listeners() if p in mine) == sorted(mine)


def test_srun_spreads_one_task_per_node(cluster):
    r = cluster.run("srun", "-N2", "-n2", "--ntasks-per-node=1", *_py("""
        import os
        e = os.environ
        print(e["SLURM_NODEID"], e["SLURMD_NODENAME"], e["SLURM_PROCID"])
        """), timeout=30)
    assert sorted(r.stdout.splitlines()) == ["0 n1 0", "1 n2 1"]


def test_scontrol_show_node(cluster):
    cluster.wait_idle()  # a step just ended shows IDLE+COMPLETING for a moment
    node = cluster.show_node("n1")
    assert node["NodeName"] == "n1"
    assert node["State"] == "IDLE"
    assert int(node["CPUTot"]) == cluster.cpus_per_node
    assert int(node["RealMemory"]) == 1024
    assert node["NodeAddr"] == "127.0.0.1"
    assert node["Partitions"] == "test"
    if GPUS:
        assert node["Gres"] == f"gpu:{GPUS}"


@pytest.mark.skipif(not GPUS, reason="stand-in GPU devices need root (mknod)")
def test_gres_gpu_sets_cuda_visible_devices(cluster):
    r = cluster.run("srun", "-N2", "-n2", "--ntasks-per-node=1", "--gres=gpu:1", *_py("""
        import os
        e = os.environ
        print(e["SLURMD_NODENAME"], e.get("CUDA_VISIBLE_DEVICES"), e.get("SLURM_GPUS_ON_NODE"))
        """), timeout=30)
    assert sorted(r.stdout.splitlines()) == ["n1 0 1", "n2 0 1"]


def test_sbatch_two_steps(cluster):
    wd = cluster.workdir
    script = textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH -N2 -n2 --ntasks-per-node=1
        srun --output={wd}/step0-%t.out bash -c 'echo step0 $SLURMD_NODENAME $SLURM_STEP_ID'
        srun --output={wd}/step1-%t.out bash -c 'echo step1 $SLURMD_NODENAME $SLURM_PROCID'
        echo batch done on $SLURMD_NODENAME
        """)
    job = cluster.sbatch(script, f"--output={wd}/batch-%j.out")
    cluster.wait_gone(job, timeout=30)
    assert cluster.job_state(job) in ("COMPLETED", "")  # '' once MinJobAge has passed
    read = lambda name: (wd / name).read_text().strip()  # noqa: E731
    assert [read("step0-0.out"), read("step0-1.out")] == ["step0 n1 0", "step0 n2 0"]
    assert [read("step1-0.out"), read("step1-1.out")] == ["step1 n1 0", "step1 n2 1"]
    assert read(f"batch-{job}.out") == "batch done on n1"


def test_scancel_ends_a_long_job(cluster):
    job = cluster.sbatch("#!/bin/bash\nsrun sleep 600\n", "-N2", "-n2", "--ntasks-per-node=1",
                         f"--output={cluster.workdir}/long-%j.out")
    cluster.wait_running(job)
    # the step's sleep on both nodes, by `scontrol listpids JOB NODE`
    deadline = time.monotonic() + 20
    while True:
        pids = cluster.job_pids(job)
        sleeps = [p for p in pids if _cmdline(p)[:1] and _cmdline(p)[0].endswith(b"sleep")]
        if len(sleeps) == 2:
            break
        assert time.monotonic() < deadline, f"no sleep on both nodes: {pids}"
        time.sleep(0.2)
    cluster.run("scancel", str(job))
    cluster.wait_gone(job, timeout=20)
    assert cluster.queue() == []
    deadline = time.monotonic() + 10
    while (alive := [p for p in pids if slurmlocal._alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive == [], f"processes of job {job} still alive: {alive}"
    # nor any sleep of the cluster at all (found by its environment)
    assert not [p for p in cluster.processes() if b"sleep" in b" ".join(_cmdline(p))]


def test_rendezvous_across_the_two_nodes(cluster):
    """torch.distributed-style: MASTER_ADDR is the first node's address (NodeAddr of the
    first host in SLURM_JOB_NODELIST), task 0 (on n1) listens there, task 1 (on n2) connects
    and both exchange their ranks."""
    port = slurmlocal.free_ports(1)[0]
    r = cluster.run("srun", "-N2", "-n2", "--ntasks-per-node=1", f"--export=ALL,MASTER_PORT={port}",
                    *_py("""
        import os, re, socket, subprocess, time
        e = os.environ
        first = subprocess.run(["scontrol", "show", "hostnames", e["SLURM_JOB_NODELIST"]],
                               capture_output=True, text=True, check=True).stdout.split()[0]
        node = subprocess.run(["scontrol", "-o", "show", "node", first],
                              capture_output=True, text=True, check=True).stdout
        addr = re.search(r"NodeAddr=(\\S+)", node).group(1)
        port, rank = int(e["MASTER_PORT"]), int(e["SLURM_PROCID"])
        if rank == 0:
            srv = socket.create_server((addr, port))
            srv.settimeout(20)
            conn, _ = srv.accept()
            peer = conn.recv(64).decode()
            conn.sendall(f"rank0@{e['SLURMD_NODENAME']}".encode())
            conn.close()
        else:
            deadline = time.monotonic() + 20
            while True:
                try:
                    conn = socket.create_connection((addr, port), timeout=5)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            conn.sendall(f"rank1@{e['SLURMD_NODENAME']}".encode())
            peer = conn.recv(64).decode()
            conn.close()
        print(rank, e["SLURMD_NODENAME"], first, addr, "got", peer)
        """), timeout=60)
    assert sorted(r.stdout.splitlines()) == [
        "0 n1 n1 127.0.0.1 got rank1@n2",
        "1 n2 n1 127.0.0.1 got rank0@n1",
    ]


def test_container_image_is_rejected_without_pyxis(cluster):
    # No pyxis SPANK plugin here: srun rejects the option before contacting slurmctld.
    r = cluster.run("srun", "--container-image=ubuntu:22.04", "-N1", "true", check=False)
    assert r.returncode != 0
    assert "unrecognized option '--container-image" in r.stderr


def test_stop_leaves_nothing(cluster):
    job = cluster.sbatch("#!/bin/bash\nsrun sleep 600\n", f"--output={cluster.workdir}/x.out")
    cluster.wait_running(job)
    pids = dict(cluster.pids)
    ports = dict(cluster.ports)
    assert set(pids) == {"munged", "slurmctld", "slurmd-n1", "slurmd-n2"}
    cluster.stop()  # cancels the job, then TERM/KILL by PID; raises if anything is left
    assert [n for n, p in pids.items() if slurmlocal._alive(p)] == []
    assert cluster.processes() == []
    assert set(ports.values()).isdisjoint(slurmlocal.listening_ports())
    assert not cluster.munge_socket.exists() or not _munge_answers(cluster)


def _cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def _munge_answers(cluster) -> bool:
    r = subprocess.run(["munge", "-n", f"--socket={cluster.munge_socket}"],
                       capture_output=True, env=cluster.env)
    return r.returncode == 0
