"""A cluster's refusal, handled once for every stage: a FAIL gate, never a SKIP.

`Unsupported` (lib.places) is a place's missing capability: the stage records a SKIP with its
reason and goes on. `PlaceError` is the cluster saying no (an API server that does not answer,
a kubectl context that is missing, an apply or an allocation refused, a pod the scheduler
cannot place, sinfo failing): `refusals_fail` records it as one FAIL gate naming the context
and the command (lib.core.stage.Stage.refuse), ends the stage's run there, and the stage's
`finish` raises once gates.json is written (papermill and `make run` exit non-zero).
`shows_refusal` makes the stage's display say so instead of drawing a table of nothing.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from lib.core.errors import PlaceError

REFUSED_KEY = "refused"  # what a refused stage's run returns: {REFUSED_KEY: the reason}


def refusals_fail(run: Callable[..., Any]) -> Callable[..., Any]:
    """A stage's `run(stage, ...)`, with a PlaceError from anywhere below it recorded as the
    stage's FAIL (the servers it opened are stopped by their own blocks as it unwinds)."""

    @functools.wraps(run)
    def guarded(stage, *args, **kwargs):
        try:
            return run(stage, *args, **kwargs)
        except PlaceError as refusal:
            stage.refuse(refusal)
            print(f"the cluster refused: {refusal}", flush=True)
            return {REFUSED_KEY: str(refusal)}

    return guarded


def shows_refusal(show: Callable[..., Any]) -> Callable[..., Any]:
    """A stage's `show(stage, data)`: a refused run says what refused, and shows nothing else."""

    @functools.wraps(show)
    def guarded(stage, data=None, *args, **kwargs):
        if isinstance(data, dict) and REFUSED_KEY in data:
            print(f"not measured: the cluster refused: {data[REFUSED_KEY]}")
            return None
        return show(stage, data, *args, **kwargs)

    return guarded
