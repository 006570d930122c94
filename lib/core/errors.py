"""Every error the guide raises on purpose, in one module (so a low layer never imports a high
one to raise, and a caller catches by meaning). Each message names what to change. The modules
that raise one re-export it where callers already import it. Not here: the two stops a signal
raises (lib.core.stage.StageInterrupted, lib.runner.Interrupted), which are a signal's control
flow (KeyboardInterrupt, BaseException), not errors, and live beside their handlers."""
from __future__ import annotations

from pathlib import Path
from typing import Any


class ParameterError(ValueError):
    """A parameter's value is not allowed; the message names it and the allowed values."""

    def __init__(self, name: str, value: Any, allowed: str):
        self.name, self.value, self.allowed = name, value, allowed
        shown = repr(value)  # a hostile 10k-character value is named, not echoed whole
        shown = shown if len(shown) <= 200 else shown[:197] + "..."
        super().__init__(f"parameter {name!r} = {shown} is not allowed; allowed: {allowed}")


class EvidenceError(RuntimeError):
    """Evidence could not be written without losing or overwriting what is recorded."""


class RunNotIntact(EvidenceError):
    """A recorded run that cannot be trusted as recorded: its files do not match SHA256SUMS, or
    it has none. Such a run is refused (replay, the book's checks), never repaired."""

    def __init__(self, run_dir: Path, message: str, problems: list):
        self.run_dir, self.problems = Path(run_dir), list(problems)
        super().__init__(message)


class RunTampered(RunNotIntact):
    """Files of a sealed run were modified, removed or added after it was sealed (or a writer's
    temporary file was left in it); the message names every such file and what is wrong."""


class RunUnsealed(RunNotIntact):
    """The run has no SHA256SUMS: it was interrupted before it was sealed, so it is incomplete
    and nothing can tell its files from files changed since."""


class BookRefused(EvidenceError):
    """The run asked for cannot be published: its evidence was changed after it was sealed."""


REFUSAL_LINES = 50  # a refusal to publish lists this many findings, then counts the rest


class PublishRefused(RuntimeError):
    """What would be published holds identities; the message lists each one (masked)."""

    def __init__(self, root: Path, findings: list):  # of lib.publish.scan.Finding
        self.root, self.findings = Path(root), list(findings)
        listed = [f"  {finding}" for finding in self.findings[:REFUSAL_LINES]]
        rest = len(self.findings) - REFUSAL_LINES
        if rest > 0:
            listed.append(f"  ... and {rest} more")
        super().__init__(
            f"refusing to publish {self.root}: {len(self.findings)} identities found "
            f"(path:line kind masked); remove or redact them in what the book is built from "
            f"(the run's evidence, book/, the notebooks), then rebuild:\n" + "\n".join(listed))


class DoorError(RuntimeError):
    """A call through the door could not be made as asked."""


class ReplayMismatch(DoorError):
    """The code asked for a call that the recorded transcript does not hold at this point."""


class PlanOnly(DoorError):
    """A plan run was asked to touch the world (a cluster, a server): plans execute nothing but
    local checkers (lib.core.door.PLAN_CHECKERS)."""


class CommandError(DoorError):
    """A command exited with a code outside its ok codes (RAN / STDOUT / STDERR, truncated)."""

    TRUNCATE = 750

    def __init__(self, result):
        self.result = result
        super().__init__(
            f"\n  RAN: {' '.join(result.argv)}\n  RC: {result.rc}"
            f"{' (timed out)' if result.timed_out else ''}\n"
            f"  STDOUT:\n{self._cut(result.stdout)}\n  STDERR:\n{self._cut(result.stderr)}"
        )

    def _cut(self, text: str) -> str:
        if len(text) <= self.TRUNCATE:
            return text
        return text[-self.TRUNCATE:] + f"\n  ... ({len(text) - self.TRUNCATE} more chars in .result)"


class PlaceError(RuntimeError):
    """A cluster refused or could not be reached: its API server or controller did not answer,
    a context is missing, an apply or an allocation was refused, a pod could not be scheduled.
    Not a missing capability of the place (that is lib.places.Unsupported, a SKIP): a stage
    records it as a FAIL gate (lib.core.stage.Stage.refuse) naming `where` (the context, e.g.
    "kube context 'my-eks'") and the command that failed, stops, and its notebook exits
    non-zero. `call` is the door's CallResult of that command, when one ran."""

    def __init__(self, where: str, what: str, call=None):
        self.where, self.what = where, what
        self.command = " ".join(call.argv) if call is not None else None
        self.rc = call.rc if call is not None else None
        self.seq = getattr(call, "seq", None)  # the call's number in the transcript
        # the client's last line says it for people (kubectl's "The connection to the server
        # ... was refused"); the whole output is in the transcript
        said = ((call.stderr or call.stdout or "").strip().splitlines() or [""])[-1][-300:] \
            if call is not None else ""
        ran = (f": `{self.command}` exited {self.rc}" + (f": {said}" if said else "")
               if call is not None else "")
        super().__init__(f"{where}: {what}{ran}")

    def observed(self) -> dict:
        """What the FAIL gate shows: where, the command and its exit code."""
        return {"where": self.where, "command": self.command, "exit_code": self.rc}


class Unsupported(Exception):
    """This place cannot do what the stage asked; str(exc) is the stage's SKIP reason."""


class NotScheduled(Exception):
    """A pod stayed Pending past schedule_timeout_s; str(exc) is the scheduler's own reason."""


class NotAllocated(Exception):
    """The allocation was refused, or did not start in time (the job cancelled already)."""

    def __init__(self, reason: str, timed_out: bool = False):
        super().__init__(reason)
        self.timed_out = timed_out


class StreamError(ValueError):
    """The log holds no complete, intact block of the files asked for."""


class StageRefused(RuntimeError):
    """Raised by a stage's finish after its gates are written, when its cluster refused
    (PlaceError): the notebook, papermill and `make run` exit non-zero."""


class PinsError(ValueError):
    """pins.yaml does not follow its schema; the message lists every problem found."""


class RootError(ValueError):
    """A pin cannot be checked as given (a short SHA, an unknown kind); raised before any call."""


class SitePatchError(RuntimeError):
    """A patch could not be applied as pinned; the site folder was left as it was."""
