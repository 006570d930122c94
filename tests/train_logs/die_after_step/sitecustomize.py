"""Makes one real training rank die mid-run, without a hook in lib/ (tests/train_logs/README.md).

On PYTHONPATH (ahead of everything else), Python imports this at start-up in every process that
inherits the environment: torchrun and the training ranks it starts. It acts only in a torchrun
rank (LOCAL_RANK is set) whose node is TRAIN_DIE_NODE (matched against SLURM_NODEID, else
TRAIN_NODE_RANK), and there it wraps stdout: once the rank has written its `moe-train step` line
for step TRAIN_DIE_AFTER_STEP, the next write of an evidence line ends the rank, as
TRAIN_DIE_HOW says:

- raise: a RuntimeError raised from inside the training's own print (a real Python traceback
  through lib.bench.moe_train, the rank's exit code 1);
- exit: os._exit(3), no word (a process killed mid-run).
"""
import os
import sys

DIE_NODE = os.environ.get("TRAIN_DIE_NODE")
NODE = os.environ.get("SLURM_NODEID", os.environ.get("TRAIN_NODE_RANK"))
AFTER_STEP = int(os.environ.get("TRAIN_DIE_AFTER_STEP", "2"))
HOW = os.environ.get("TRAIN_DIE_HOW", "raise")


class _DiesAfterStep:
    """stdout, until the step line of AFTER_STEP has been written; the next line ends the rank."""

    def __init__(self, stream):
        self._stream = stream
        self._armed = False

    def write(self, text):
        if self._armed and text.startswith("moe-train "):
            self._stream.flush()
            if HOW == "exit":
                os._exit(3)
            raise RuntimeError(f"this rank dies after step {AFTER_STEP} "
                               "(tests/train_logs/die_after_step)")
        written = self._stream.write(text)
        if text.startswith("moe-train step ") and f'"step": {AFTER_STEP},' in text:
            self._armed = True
        return written

    def __getattr__(self, name):
        return getattr(self._stream, name)


if DIE_NODE is not None and NODE == DIE_NODE and "LOCAL_RANK" in os.environ:
    sys.stdout = _DiesAfterStep(sys.stdout)
