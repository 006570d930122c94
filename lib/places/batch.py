"""What the slurm place runs, as data and text: sbatch and srun argv, the per-node wrapper
script, the node probe script, and the parsers of what Slurm and the probe print back.

Nothing here runs anything: lib.places.slurm sends these through the door, and a plan for
slurm (lib.places.slurm_plan.SlurmPlan) renders the same lines and scripts without a cluster. Every
script rendered here is bash that shellcheck passes (tests/test_slurm_place.py runs it).

The shapes:

- the allocation: `sbatch --parsable` of a holder (`exec sleep infinity`) over N whole nodes,
  one task per node (`alloc_argv`); its job id is known the moment it is submitted, so it can
  always be cancelled (`scancel <jobid>`), pending or running;
- one step across the allocation (`step_argv`): `srun --jobid=<id> -N<n> --ntasks-per-node=1
  --kill-on-bad-exit=1`, each node's output into files `<base>-node%n.out|.err` on a folder
  the nodes share, the command `bash -c <script> <name>`;
- the wrapper (`wrapper_script`): one script for every node, which picks the node's argv and
  env by `$SLURM_NODEID` and writes the node's exit code to `<base>-node<N>.rc`, also when
  the step ends it with SIGTERM (its TERM trap lets the command end, then records its code);
- the probe (`probe_script`): the facts the local place reads, one `probe:<key>=<value>` line
  each (`parse_probe` reads them back);
- one task on one node of an allocation, beside the others (`task_argv`: `srun --jobid=<id>
  --overlap -N1 -n1 --nodelist=<node>`): a server (transformers serve, a vLLM leader or
  worker), AIPerf against it, a read of the served model's config; its environment set by
  `env` in its argv, so the line says everything the task gets over the exported one;
- a plan's view of an allocation as one batch script (`batch_script`): the holder's options as
  `#SBATCH` lines, then every step in the order the place runs them (`task_script`: a one-task
  step's command as a script of its own).
"""
from __future__ import annotations

import re
import shlex
import signal
from typing import Any, Sequence

from lib.places.local import meminfo_kib

# The rendezvous port node 0 listens on, on a real cluster: a constant, since this machine
# cannot know which ports are free on node 0 (the same one a plan records: plan.py's 29500).
RDZV_PORT = 29500
HOLDER = "exec sleep infinity"  # the allocation's batch step: it only holds the nodes
# A serve's ports on node 0, on a real cluster (this machine cannot know which are free there;
# a serve beside another in the same allocation takes the next: lib.places.slurm). vLLM's HTTP
# port, and its data-parallel rendezvous (leader and workers), as the kube place uses them.
SERVE_PORT = 8000
DP_RPC_PORT = 29570
PROBE_PREFIX = "probe:"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# srun's report of a task that did not exit 0: "srun: error: n2: task 1: Exited with exit code 3",
# "srun: error: n1: task 0: Killed", "srun: error: n[1-2]: tasks 0-1: Terminated"
_SRUN_TASKS = re.compile(r"^srun: error: \S+: tasks? ([0-9,\-]+): (.+?)\s*$", re.M)
_EXITED = re.compile(r"^Exited with exit code (\d+)$")


def slug(name: str) -> str:
    """A job's name as a file name part: 'test_ep at 128 tokens' -> 'test_ep-at-128-tokens'."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", name).strip("-.") or "job"


# ---- argv ---------------------------------------------------------------------------------------
def alloc_argv(*, name: str, nodes: int, time_min: int, partition: str = "", account: str = "",
               gpus_per_node: int = 0) -> list[str]:
    """sbatch of the allocation: N whole nodes (--exclusive, all their memory), one task per
    node, every GPU of a node by GRES where the nodes declare them (`--gres=gpu:N`, per node,
    which select/cons_res knows too, unlike --gpus-per-node); it prints its job id
    (--parsable)."""
    return [
        "sbatch", "--parsable", f"--job-name={name}", f"--nodes={nodes}",
        "--ntasks-per-node=1", "--exclusive", "--mem=0", f"--time={time_min}",
        *([f"--partition={partition}"] if partition else []),
        *([f"--account={account}"] if account else []),
        *([f"--gres=gpu:{gpus_per_node}"] if gpus_per_node else []),  # per node
        "--output=/dev/null", f"--wrap={HOLDER}",
    ]


def step_argv(*, jobid: str, nodes: int, out_base: str, time_min: int, script: str,
              script_name: str, chdir: str, cpus_per_task: int | None = None,
              gpus_per_node: int = 0, image: str = "", mounts: Sequence[str] = (),
              kill_on_bad_exit: bool = True) -> list[str]:
    """srun of one step over every node of the allocation, one task per node; node N's output
    into `<out_base>-nodeN.out` and `.err` (%n: the node's index in the job, = SLURM_NODEID).

    `image`: the step runs in it through pyxis (`--container-image`, the `mounts` at the same
    paths, `--container-workdir` = `chdir`); without it, on the nodes themselves."""
    container = _container_args(image, mounts, chdir)
    return [
        "srun", f"--jobid={jobid}", f"--nodes={nodes}", f"--ntasks={nodes}",
        "--ntasks-per-node=1",
        *([f"--cpus-per-task={cpus_per_task}"] if cpus_per_task else []),
        *([f"--gres=gpu:{gpus_per_node}"] if gpus_per_node else []),  # per node
        f"--kill-on-bad-exit={1 if kill_on_bad_exit else 0}", "--mpi=none",
        f"--time={time_min}", f"--chdir={chdir}", "--export=ALL",
        f"--output={out_base}-node%n.out", f"--error={out_base}-node%n.err",
        *container, "bash", "-c", script, script_name,
    ]


def env_argv(env: dict[str, str] | None = None, unset: Sequence[str] = ()) -> list[str]:
    """`env -u U ... K=V ...`: what a task gets over the environment srun exports ([] when
    nothing)."""
    bad = [k for k in [*(env or {}), *unset] if not ENV_NAME.match(k)]
    if bad:
        raise ValueError(f"not an environment variable name: {bad[0]!r}")
    if not env and not unset:
        return []
    return (["env"] + [a for u in unset for a in ("-u", u)]
            + [f"{k}={v}" for k, v in sorted((env or {}).items())])


def _container_args(image: str, mounts: Sequence[str], chdir: str) -> list[str]:
    """pyxis's flags for a step in `image` (none without one)."""
    if not image:
        return []
    return ([f"--container-image={image}"]
            + ([f"--container-mounts={','.join(f'{m}:{m}' for m in mounts)}"] if mounts else [])
            + [f"--container-workdir={chdir}"])


def task_argv(*, jobid: str, node: str, name: str, time_min: int, chdir: str,
              argv: Sequence[str], env: dict[str, str] | None = None, unset: Sequence[str] = (),
              gpus_per_node: int = 0, output: str = "", error: str = "", image: str = "",
              mounts: Sequence[str] = ()) -> list[str]:
    """srun of one task on one node of the allocation, beside its other steps (`--overlap`:
    a server's step and AIPerf's share the node's CPUs, memory and GPUs), named `name` (what
    `squeue -s` lists, so its steps can be found and cancelled), stdin closed. Its output into
    `output`/`error` when given, else back through srun (a server's: the door's log file).
    `image`: in it through pyxis, as step_argv."""
    container = _container_args(image, mounts, chdir)
    return [
        "srun", f"--jobid={jobid}", "--overlap", "--nodes=1", "--ntasks=1",
        f"--nodelist={node}", f"--job-name={name}",
        *([f"--gres=gpu:{gpus_per_node}"] if gpus_per_node else []),
        "--mpi=none", f"--time={time_min}", f"--chdir={chdir}", "--export=ALL",
        "--input=none", *([f"--output={output}"] if output else []),
        *([f"--error={error}"] if error else []),
        *container, *env_argv(env, unset), *[str(a) for a in argv],
    ]


def world_argv(*, jobid: str, nodes: Sequence[str], name: str, time_min: int, chdir: str,
               argv: Sequence[str], tasks_per_node: int, mpi: str,
               env: dict[str, str] | None = None, unset: Sequence[str] = (), image: str = "",
               mounts: Sequence[str] = ()) -> list[str]:
    """srun of one MPI world over the allocation's `nodes`: `tasks_per_node` tasks on each
    (one per GPU, each seeing every GPU of its node: the engine picks its device by local
    rank), wired by Slurm's `--mpi` plugin (pmix on most clusters; `srun --mpi=list` says), every
    output line labelled with its task (`-l`: "<rank>: "). The shape of TensorRT-LLM's own
    Slurm example (examples/llm-api/llm_mgmn_trtllm_serve.sh: sbatch -N 2
    --ntasks-per-node=8, then srun -l --mpi=pmix of trtllm-llmapi-launch trtllm-serve).
    `--overlap` and the rest as task_argv."""
    container = _container_args(image, mounts, chdir)
    return [
        "srun", f"--jobid={jobid}", "--overlap", f"--nodes={len(nodes)}",
        f"--ntasks-per-node={tasks_per_node}", f"--ntasks={len(nodes) * tasks_per_node}",
        f"--nodelist={','.join(nodes)}", f"--job-name={name}",
        f"--gres=gpu:{tasks_per_node}", f"--mpi={mpi}", "--label", f"--time={time_min}",
        f"--chdir={chdir}", "--export=ALL", "--input=none",
        *container, *env_argv(env, unset), *[str(a) for a in argv],
    ]


def cancel_argv(jobid: str) -> list[str]:
    """scancel of a job (`<jobid>`) or of one of its steps (`<jobid>.<step>`)."""
    return ["scancel", str(jobid)]


def steps_argv(jobid: str) -> list[str]:
    """The job's steps, one `<jobid>.<step>|<name>` line each (its batch step included)."""
    return ["squeue", "-h", "-s", "-j", str(jobid), "-o", "%i|%j"]


def queue_argv(jobid: str) -> list[str]:
    """The job's state, its reason and its nodes, one line ('' once it has left the queue)."""
    return ["squeue", "-h", "-j", str(jobid), "-o", "%T|%r|%N"]


def show_job_argv(jobid: str) -> list[str]:
    """The job as slurmctld keeps it (MinJobAge s after it ends): JobState, Reason, Restarts."""
    return ["scontrol", "-o", "show", "job", str(jobid)]


def sinfo_argv(partition: str = "") -> list[str]:
    return ["sinfo", "-N", "-h", *([f"--partition={partition}"] if partition else []),
            "-o", "%N|%P|%T|%c|%m|%G|%f"]


def hostnames_argv(nodelist: str) -> list[str]:
    return ["scontrol", "show", "hostnames", nodelist]


def show_node_argv(nodes: str) -> list[str]:
    return ["scontrol", "-o", "show", "node", nodes]


# ---- scripts ------------------------------------------------------------------------------------
def _env_line(env: dict[str, str]) -> str:
    bad = [k for k in env if not ENV_NAME.match(k)]
    if bad:
        raise ValueError(f"not an environment variable name: {bad[0]!r}")
    return "export " + " ".join(f"{k}={shlex.quote(str(v))}" for k, v in sorted(env.items()))


def wrapper_script(name: str, per_node: Sequence[tuple[Sequence[str], dict[str, str]]],
                   out_base: str) -> str:
    """One bash script for every node of a step: node N (`$SLURM_NODEID`) runs per_node[N]'s
    argv with its env exported, then writes its exit code to `<out_base>-nodeN.rc`.

    A SIGTERM (the step cancelled: --kill-on-bad-exit after another node failed, scancel, the
    time limit) reaches the command too; the trap only keeps bash alive until the command has
    ended, so the code it ended with is still recorded (143 for a TERM it did not handle)."""
    lines = [
        "#!/bin/bash",
        "# shellcheck disable=SC2016  # every argv element is literal: a '$' in one is data",
        f"# {name}: one task per node; node N runs its own argv and env (SLURM_NODEID = N)",
        "set -u",
        'node="${SLURM_NODEID:?not a Slurm task: SLURM_NODEID is unset}"',
        f'rc_file={shlex.quote(out_base + "-node")}"$node".rc',
        "trap 'echo \"node $node: SIGTERM (the step is being ended)\" >&2' TERM",
        'case "$node" in',
    ]
    for rank, (argv, env) in enumerate(per_node):
        lines.append(f"  {rank})")
        if env:
            lines.append(f"    {_env_line(env)}")
        lines.append(f"    cmd=({' '.join(shlex.quote(str(a)) for a in argv)})")
        lines.append("    ;;")
    lines += [
        "  *)",
        '    echo "node $node: this step has no command for it" >&2',
        "    exit 64",
        "    ;;",
        "esac",
        '"${cmd[@]}"',
        "rc=$?",
        'printf \'%s\\n\' "$rc" > "$rc_file"',
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


def task_script(name: str, argv: Sequence[str], tasks: str = "one task on one node") -> str:
    """A step's command (what each of its tasks runs) as a bash script of its own (a plan shows
    and checks it); `tasks`: where its tasks run."""
    return ("#!/bin/bash\n"
            f"# {name}: {tasks} of the allocation\n"
            "set -u\n"
            f"exec {' '.join(shlex.quote(str(a)) for a in argv)}\n")


# The options of a step that a batch script's own steps take from their job.
_JOB_OF_STEP = re.compile(r"^--jobid=")
# The holder's options that are the holder's own, not the allocation's.
_HOLDER_ONLY = re.compile(r"^--(parsable|wrap=.*|output=/dev/null)$")


def batch_script(name: str, alloc: Sequence[str],
                 steps: Sequence[tuple[Sequence[str], bool, str]], notes: Sequence[str] = ()
                 ) -> str:
    """A plan's view of one allocation as one batch script: `alloc` (alloc_argv's sbatch) as
    `#SBATCH` lines, then each step (srun argv, whether the place leaves it running in the
    background, a comment) in the order the place runs them; `--jobid` dropped, since a batch
    script's steps are its job's. The place itself submits the holder and runs each step from
    this machine (srun --jobid): the same options, the same commands."""
    lines = ["#!/bin/bash",
             "# shellcheck disable=SC2016  # a step's script is one literal word: its '$' is data",
             f"# {name}: the allocation and its steps, as the slurm place runs them (it submits "
             "the holder, then each step with srun --jobid from the machine that runs the "
             "guide)"]
    lines += [f"# {n}" for n in notes]
    lines += [f"#SBATCH {a}" for a in alloc[1:] if a.startswith("--")
              and not _HOLDER_ONLY.match(a)]
    lines += ["set -u"]
    background = False
    for argv, bg, note in steps:
        if note:
            lines.append(f"# {note}")
        words = " ".join(shlex.quote(str(a)) for a in argv if not _JOB_OF_STEP.match(str(a)))
        lines.append(words + (" &" if bg else ""))
        background = background or bg
    if background:
        lines += ["# the place stops its background steps when their stage is done with them",
                  "wait"]
    return "\n".join(lines) + "\n"


PROBE_SCRIPT = r"""#!/bin/bash
# The node probe: the facts the local place reads, one `probe:<key>=<value>` line each.
set -u
say() { printf 'probe:%s=%s\n' "$1" "$2"; }
say node "${SLURMD_NODENAME:-?}"
say node_id "${SLURM_NODEID:-?}"
say hostname "$(uname -n)"
say cpu_cores "$(grep -c '^processor' /proc/cpuinfo)"
say cpu_model "$(sed -n 's/^model name[[:space:]]*:[[:space:]]*//p' /proc/cpuinfo | head -n 1)"
grep -E '^(MemTotal|HugePages_Total|Hugepagesize):' /proc/meminfo | while IFS= read -r line; do
  say meminfo "$line"
done
for dev in /sys/class/infiniband/*; do
  [ -e "$dev" ] || continue
  driver="$(sed -n 's/^DRIVER=//p' "$dev/device/uevent" 2>/dev/null)"
  say rdma "${dev##*/} ${driver:-?}"
done
if [ -r /sys/module/gdrdrv/version ]; then
  say gdrdrv "$(cat /sys/module/gdrdrv/version)"
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader,nounits \
    | while IFS= read -r line; do say gpu "$line"; done
fi
say end ok
"""


def probe_script() -> str:
    return PROBE_SCRIPT


# ---- parsers ------------------------------------------------------------------------------------
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
