"""Every error the guide raises on purpose, in one module (so a low layer never imports a high
one to raise, and a caller catches by meaning). Each message names what to change."""
from __future__ import annotations

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


class StageRefused(RuntimeError):
    """Raised by a stage's finish after its gates are written, when its cluster refused
    (PlaceError): the notebook, papermill and `make run` exit non-zero."""


class PinsError(ValueError):
    """pins.yaml does not follow its schema; the message lists every problem found."""


class RootError(ValueError):
    """A pin cannot be checked as given (a short SHA, an unknown kind); raised before any call."""


class SitePatchError(RuntimeError):
    """A patch could not be applied as pinned; the site folder was left as it was."""
