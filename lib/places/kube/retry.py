"""kubectl calls that outlive an API server restart, for the kube place (lib.places.kube).

An API server restarts under a stage: an EKS control-plane update rolls its instances, a
self-managed one is restarted for a flag. For those seconds kubectl cannot connect and says so
("The connection to the server 127.0.0.1:6443 was refused - did you specify the right host or
port?", kubectl's own words: kubernetes/website#23389; "Unable to connect to the server: ..."
when the address does not answer; HTTP 503 "the server is currently unable to handle the
request" while it starts). Such a call is tried again, each try a call through the door
(recorded in the transcript, replayed in turn), until it answers or API_RETRY_S has passed.

Which calls are safe to try again, and why (said once, here):
- reads (`get`, `logs`, `version`): they change nothing, a second try sees what the first
  would have;
- `delete ... -l <this run's labels> --ignore-not-found`: deleting again what is gone is a
  no-op, and the selector names only this run's objects;
- `apply`: never blindly. An apply that failed on the connection may still have landed (the
  request sent, the answer lost), so it is followed by `kubectl get -f <the same file>`: the
  objects found are not applied again; only when some are missing is the file applied once
  more (kubectl apply leaves unchanged what it finds as the file says) — `apply_landed`;
- `exec` never: what it ran in the pod (a chat request, a /metrics read a sweep counts) may
  have run already.
Anything else (a refusal: Forbidden, Invalid, NotFound) is the cluster's answer, not a
transient: returned at once, as the caller reads it.
"""
from __future__ import annotations

import json
from typing import Callable

from tenacity import Retrying, retry_if_result, wait_exponential

from lib.core.door import CallResult
from lib.core.errors import PlaceError
from lib.places.kube.pods import foreign_objects

# How long a call keeps trying while the API server does not answer. An API server restart
# of the test plane (tests/kubeplane.py, 1.20.2: TERM, then /readyz again) takes a few
# seconds; an EKS control-plane update replaces its instances behind the same endpoint, with
# the connection refused for well under a minute at a time. One minute, then the stage
# records the refusal (lib.core.errors.PlaceError) naming the call.
API_RETRY_S = 60.0
FIRST_DELAY_S = 1.0  # doubling up to MAX_DELAY_S between two tries
MAX_DELAY_S = 4.0

# What kubectl prints when it reached no API server (or one still starting): a try again.
TRANSIENT = (
    "was refused - did you specify the right host or port?",  # kubectl: connection refused
    "connect: connection refused",  # Go's dial error: `apply` downloading the OpenAPI schema
    "Unable to connect to the server",                       # kubectl: no answer, TLS, DNS
    "connection reset by peer",
    "unexpected EOF",
    "TLS handshake timeout",
    "http2: server sent GOAWAY",
    "the server is currently unable to handle the request",  # 503 while it starts
    "etcdserver: request timed out",
    "etcdserver: leader changed",
)
SAFE_VERBS = ("get", "logs", "version", "delete")


def retry_budget(answered: bool) -> float:
    """How long a call may keep trying: API_RETRY_S once the API server has answered in this
    stage (a restart is a server that answered, then went away), none before (a cluster that
    has not answered once is the stage's refusal at its first call, not a wait of a minute)."""
    return API_RETRY_S if answered else 0.0


def is_transient(call: CallResult) -> bool:
    """Whether kubectl failed for want of an API server, not by its answer."""
    if call.ok:
        return False
    said = f"{call.stderr}\n{call.stdout}"
    return any(words in said for words in TRANSIENT)


def verb_of(argv: list[str]) -> str | None:
    """kubectl's verb: the first argument after its global flags (--context X, --namespace X)."""
    k = 1
    while k < len(argv) and argv[k].startswith("--"):
        k += 1 if "=" in argv[k] else 2
    return argv[k] if k < len(argv) else None


def run_retrying(door, argv: list[str], *, timeout: float, budget_s: float = API_RETRY_S,
                 say: Callable[[str], None] = print) -> CallResult:
    """`argv` (a kubectl call whose verb is in SAFE_VERBS) through the door, tried again while
    it fails for want of an API server (TRANSIENT), for up to `budget_s`: the last try's result.
    Every try is its own recorded call; each retry is said (`say`) with what kubectl said."""
    verb = verb_of(argv)
    if verb not in SAFE_VERBS:
        raise ValueError(f"kubectl {verb!r} is not retried blindly (safe: "
                         f"{', '.join(SAFE_VERBS)}; apply goes through apply_landed)")
    clock: list[float] = []  # the door's clock once the first try failed

    def out_of_time(state) -> bool:
        if not clock:
            clock.append(door.now())
        return door.now() - clock[0] >= budget_s

    def said_retry(state) -> None:
        call = state.outcome.result()
        said = (call.stderr or call.stdout).strip().splitlines()[-1:] or [""]
        say(f"kubectl {verb}: the API server did not answer ({said[0][:160]}); "
            f"try {state.attempt_number + 1} in {state.next_action.sleep:.0f} s")

    # tenacity's loop on the door's clock and sleep: every try a recorded call, replayed in turn
    trying = Retrying(retry=retry_if_result(is_transient), stop=out_of_time,
                      wait=wait_exponential(multiplier=FIRST_DELAY_S, max=MAX_DELAY_S),
                      sleep=door.sleep, before_sleep=said_retry,
                      retry_error_callback=lambda state: state.outcome.result())
    return trying(lambda: door.run(argv, timeout=timeout, check=False))


def found_all(get_call: CallResult, expected: int) -> bool:
    """Whether `kubectl get -f <file> -o json --ignore-not-found` found all `expected` objects
    of the file (a List of what exists; an absent one is left out)."""
    if not get_call.ok:
        return False
    try:
        got = json.loads(get_call.stdout) if get_call.stdout.strip() else {}
    except ValueError:
        return False
    items = got.get("items") if got.get("kind") == "List" else ([got] if got else [])
    return len(items or []) >= expected


def apply_landed(door, apply_argv: list[str], get_argv: list[str], expected: int, *,
                 timeout: float, budget_s: float = API_RETRY_S,
                 say: Callable[[str], None] = print) -> CallResult:
    """An apply that outlives an API server restart, never applied twice blindly: when it fails
    for want of an API server, `get_argv` (kubectl get -f <the file> -o json --ignore-not-found,
    retried as a read) says whether its `expected` objects landed; if they all did, the apply
    is not repeated (its result is the get's); else it is applied once more (and so on, within
    `budget_s`). Every try is a recorded call."""
    started = door.now()
    call = door.run(apply_argv, timeout=timeout, check=False)
    while is_transient(call):
        left = budget_s - (door.now() - started)
        if left <= 0:
            return call
        say("kubectl apply: the API server did not answer; looking whether the objects "
            "landed before applying again")
        seen = run_retrying(door, get_argv, timeout=timeout, budget_s=left, say=say)
        if is_transient(seen):
            return call  # still no API server: the apply's own failure is the answer
        if found_all(seen, expected):
            say(f"kubectl apply: all {expected} object(s) are there: not applied again")
            return seen
        call = door.run(apply_argv, timeout=timeout, check=False)
    return call


def apply_once(door, kubectl: Callable[..., list[str]], path: str, expected: int,
               run_label: str, where: str, *, timeout: float,
               answered: bool = True) -> CallResult:
    """`kubectl apply -f path` of `expected` objects for the run labelled `run_label`: first a
    look (`kubectl get -f path`) for objects of these names that another run applied, refused
    (PlaceError naming them: two runs in one namespace would take over each other's objects),
    then the apply, through apply_landed. `kubectl(*args)`: the place's argv builder."""
    found = kubectl("get", "-f", path, "-o", "json", "--ignore-not-found")
    seen = run_retrying(door, found, timeout=timeout, budget_s=retry_budget(answered))
    theirs = foreign_objects(seen.stdout, run_label) if seen.ok else []
    if theirs:
        raise PlaceError(where, f"{', '.join(theirs)} of another run already in the namespace: "
                         "two runs in one namespace at once would take over each other's "
                         "objects; wait for that run to end, or give this one another "
                         "namespace (-p namespace)")
    return apply_landed(door, kubectl("apply", "-f", path), found, expected, timeout=timeout,
                        budget_s=retry_budget(answered or seen.ok))
