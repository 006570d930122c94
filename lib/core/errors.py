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
    """A place's cluster did not do what was asked (nodes not allocated in time, an allocation
    refused, its clients absent); the message says what, and what to change."""


class PinsError(ValueError):
    """pins.yaml does not follow its schema; the message lists every problem found."""


class RootError(ValueError):
    """A pin cannot be checked as given (a short SHA, an unknown kind); raised before any call."""


class SitePatchError(RuntimeError):
    """A patch could not be applied as pinned; the site folder was left as it was."""
