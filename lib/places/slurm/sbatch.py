"""What the slurm place sends, as data and text: sbatch and srun argv, the per-node wrapper
script, the node probe script, and a plan's batch script (what comes back is read by
lib.places.slurm.parse).

Nothing here runs anything: the slurm place (lib.places.slurm.place) sends these through the
door, and the same place in a plan (lib.places.slurm.plan.SlurmPlanned) renders the same lines and scripts
without a cluster. Every script rendered here is bash that shellcheck passes
(tests/test_slurm_place.py runs it).

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
  each (lib.places.slurm.parse.parse_probe reads them back);
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
from typing import Sequence

# The rendezvous port node 0 listens on, on a real cluster: a constant, since this machine
# cannot know which ports are free on node 0 (the same one a plan for slurm records).
RDZV_PORT = 29500
HOLDER = "exec sleep infinity"  # the allocation's batch step: it only holds the nodes
# A serve's ports on node 0, on a real cluster (this machine cannot know which are free there;
# a serve beside another in the same allocation takes the next: lib.places.slurm.serve). vLLM's
# HTTP port, and its data-parallel rendezvous (leader and workers), as the kube place uses them.
SERVE_PORT = 8000
DP_RPC_PORT = 29570
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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
