"""Reading what Slurm and the node probe print back, for the slurm place (lib.places.slurm): pure
parsers of sinfo's, scontrol's and squeue's lines, of srun's report of its tasks and
slurmstepd's CANCELLED lines, of a wrapper's `.rc` file, and of the node probe's `probe:` lines
(the probe script itself, and every argv, is lib.places.slurm.sbatch's).
"""
from __future__ import annotations

import re
import signal
from typing import Any

from lib.places.local import meminfo_kib


PROBE_PREFIX = "probe:"
# srun's report of a task that did not exit 0: "srun: error: n2: task 1: Exited with exit code 3",
# "srun: error: n1: task 0: Killed", "srun: error: n[1-2]: tasks 0-1: Terminated"
_SRUN_TASKS = re.compile(r"^srun: error: \S+: tasks? ([0-9,\-]+): (.+?)\s*$", re.M)
_EXITED = re.compile(r"^Exited with exit code (\d+)$")


def parse_probe(text: str | None) -> dict[str, Any]:
    """One node's probe output -> the local place's fact keys (and `probe_complete`: whether
    the probe reached its last line)."""
    values: dict[str, list[str]] = {}
    for line in (text or "").splitlines():
        if line.startswith(PROBE_PREFIX) and "=" in line:
            key, _, value = line[len(PROBE_PREFIX):].partition("=")
            values.setdefault(key, []).append(value)
    one = lambda key: (values.get(key) or [None])[0]  # noqa: E731
    meminfo = "\n".join(values.get("meminfo", []))
    rdma = [v.split(" ", 1) for v in values.get("rdma", [])]
    gpus = []
    for line in values.get("gpu", []):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and parts[0].isdigit():
            gpus.append({"index": int(parts[0]), "name": parts[1],
                         "memory_mib": int(float(parts[2])), "driver": parts[3]})
    cores = one("cpu_cores")
    return {
        "probed_node": one("node"),
        "hostname": one("hostname"),
        "cpu_cores": int(cores) if cores and cores.isdigit() else 0,
        "cpu_model": one("cpu_model") or None,
        "memory_gib": round((meminfo_kib(meminfo, "MemTotal") or 0) / 2**20, 1),
        "hugepages_total": meminfo_kib(meminfo, "HugePages_Total"),
        "hugepage_size_kib": meminfo_kib(meminfo, "Hugepagesize"),
        "gpus": gpus,
        "rdma_devices": [d[0] for d in rdma],
        "efa_devices": [d[0] for d in rdma if len(d) > 1 and d[1] == "efa"],
        "gdrdrv_version": (one("gdrdrv") or "").strip() or None,
        "probe_complete": one("end") == "ok",
    }


def gres_gpus(gres: str | None) -> int:
    """GPUs in a GRES string: 'gpu:8', 'gpu:h200:8(S:0-1)', 'gpu:4,shard:8' -> 8, 8, 4;
    '(null)' or '' -> 0."""
    total = 0
    for item in re.split(r",(?![^(]*\))", gres or ""):
        fields = re.sub(r"\(.*?\)", "", item).split(":")
        if fields[0] == "gpu" and len(fields) >= 2 and fields[-1].isdigit():
            total += int(fields[-1])
    return total


# sinfo's states of a node that runs jobs (a suffix '*' = not responding, '~' = powered off,
# '#' = powering up, '!' = powering down, '%' = powering off, '$' = maintenance, '@' = reboot)
USABLE_STATES = ("idle", "mixed", "allocated", "completing", "planned")


def usable(state: str | None) -> bool:
    """Whether a node in this sinfo state runs jobs ('idle', 'mixed', 'allocated', ...; not
    'down', 'drained', 'draining', 'fail', nor any state with a flag suffix)."""
    return (state or "") in USABLE_STATES


def _listed(value: str | None) -> list[str]:
    return [] if value in (None, "", "(null)") else value.split(",")


def parse_sinfo(text: str) -> list[dict[str, Any]]:
    """`sinfo -N -h -o '%N|%P|%T|%c|%m|%G|%f'` -> one row per node (its first partition's line;
    `default` when that partition is the default, '*')."""
    rows: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 7 or parts[0] in rows:
            continue
        node, partition, state, cpus, memory, gres, features = parts
        rows[node] = {"node": node, "partition": partition.rstrip("*"),
                      "default": partition.endswith("*"), "slurm_state": state,
                      "slurm_cpus": int(cpus) if cpus.isdigit() else None,
                      "slurm_memory_mib": int(memory) if memory.isdigit() else None,
                      "gres": gres, "gres_gpus": gres_gpus(gres),
                      "features": _listed(features)}
    return list(rows.values())


def parse_scontrol(line: str) -> dict[str, str]:
    """One `scontrol -o show ...` line -> {key: value} (a value may hold spaces only in the last
    keys scontrol prints, e.g. Reason=...; kept whole)."""
    return {m.group(1): m.group(2) for m in
            re.finditer(r"(\S+?)=(.*?)(?=\s+\S+?=|\s*$)", line.strip())}


def parse_nodes(text: str) -> dict[str, dict[str, Any]]:
    """`scontrol -o show node <nodes>` -> {node: the facts the place keeps}."""
    out = {}
    for line in text.splitlines():
        raw = parse_scontrol(line)
        if "NodeName" not in raw:
            continue
        cpus = raw.get("CPUEfctv") or raw.get("CPUTot") or ""
        memory = raw.get("RealMemory", "")
        out[raw["NodeName"]] = {
            "node_addr": raw.get("NodeAddr"), "node_hostname": raw.get("NodeHostName"),
            "scontrol_state": raw.get("State"),
            "slurm_cpus": int(cpus) if cpus.isdigit() else None,
            "slurm_memory_mib": int(memory) if memory.isdigit() else None,
            "gres": raw.get("Gres"), "gres_gpus": gres_gpus(raw.get("Gres")),
            "features": _listed(raw.get("AvailableFeatures")),
        }
    return out


def parse_queue(text: str) -> tuple[str, str, str] | None:
    """`squeue -h -j J -o '%T|%r|%N'` -> (state, reason, nodelist); None once the job has left
    the queue."""
    line = next((l for l in text.splitlines() if l.strip()), "")
    parts = line.strip().split("|")
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 else None


def _signal_codes() -> dict[str, int]:
    codes = {}
    for sig in signal.Signals:
        described = signal.strsignal(sig)
        if described:
            codes.setdefault(described, 128 + int(sig))
    return codes


def _tasks(spec: str) -> list[int]:
    tasks = []
    for part in spec.split(","):
        low, _, high = part.partition("-")
        if low.isdigit() and (not high or high.isdigit()):
            tasks += range(int(low), int(high or low) + 1)
    return tasks


def srun_report(stderr: str) -> dict[int, int]:
    """{task: exit code} from srun's own report of the tasks that did not exit 0; a task ended
    by a signal as the shell writes it (128 + the signal: Killed 137, Terminated 143)."""
    signals = _signal_codes()
    codes: dict[int, int] = {}
    for m in _SRUN_TASKS.finditer(stderr or ""):
        what = m.group(2).replace(" (core dumped)", "")
        exited = _EXITED.match(what)
        code = int(exited.group(1)) if exited else signals.get(what)
        if code is None:
            continue
        for task in _tasks(m.group(1)):
            codes.setdefault(task, code)
    return codes


def parse_steps(text: str) -> list[tuple[str, str]]:
    """`squeue -h -s -j J -o '%i|%j'` -> [(step id, step name)]."""
    out = []
    for line in text.splitlines():
        step, sep, name = line.strip().partition("|")
        if sep and step:
            out.append((step, name))
    return out


# slurmstepd's line of a step (or job) Slurm ended, in the task's stderr: "*** STEP 7.0 ON n1
# CANCELLED AT 2026-12-04T03:16:12 DUE TO NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***"
_ENDED = re.compile(r"\*\*\* (STEP|JOB) (\S+) ON (\S+) CANCELLED AT \S+(?: DUE TO ([A-Z ]+?))?"
                    r"(?:,[^*]*)? \*\*\*")


def parse_ended(text: str | None) -> list[dict[str, str]]:
    """slurmstepd's CANCELLED lines -> [{what, id, node, due}] (due '' for a plain scancel)."""
    return [{"what": m.group(1), "id": m.group(2), "node": m.group(3), "due": m.group(4) or ""}
            for m in _ENDED.finditer(text or "")]


def parse_rc(text: str | None) -> int | None:
    """A wrapper's .rc file -> its exit code (None when absent or not a number)."""
    value = (text or "").strip()
    return int(value) if re.fullmatch(r"-?\d+", value) else None
