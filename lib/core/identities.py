"""Cluster identities, pseudonymised consistently within a run before the door writes anything.

What counts as an identity (what lib/publish/scan.py refuses to publish):
- a private IPv4 address: 10/8, 172.16/12, 192.168/16 and 100.64/10 (carrier-grade NAT, which
  EKS pods and peered VPCs hand out); loopback, 0.0.0.0 and public addresses are left alone;
- an EC2 host name: `ip-10-1-2-3`, alone or as `ip-10-1-2-3.ec2.internal` or
  `ip-10-1-2-3.<region>.compute.internal`, and any other `<name>[.<region>].compute.internal` or
  `<name>.ec2.internal` (resource-based naming puts the instance id there);
- an AWS account id: the 12 digits of an ARN, of an ECR registry host
  (`<id>.dkr.ecr.<region>.amazonaws.com`) or after an `account`/`account_id` key.

The pseudonyms, and why these:
- a host is `node-K`. Only the host's own label is replaced, so `ip-10-1-2-3.ec2.internal` reads
  `node-K.ec2.internal`: the region and the kind of name stay, and "rank 3 on node-1" reads like
  the plan context's `node-0`, `node-1` (lib/places/kube/plan.py, lib/places/slurm/plan.py),
  which stand for the same thing.
- an address is 198.51.100.K (then 203.0.113.K-256, then `addr-K`). An address stays shaped like
  one, so whatever parses it still can (slurm's loopback test with ipaddress, vLLM's
  `tcp://host:port`, a reader scanning a log), and it is taken from RFC 5737's documentation
  blocks, which no network routes, so a pseudonym never names a machine of any cluster.
  192.0.2.0/24, the first such block, is left to the project's own test data (tests/compose.py,
  the vLLM fixtures' `mq_connect_ip=192.0.2.2`), which must stay as it is.
- K is shared by a host and its address: EC2's `ip-10-1-2-3` IS 10.1.2.3, so when it is
  `node-3`, 10.1.2.3 is 198.51.100.3 and a reader can pair a node's name with its address. K
  counts machines (and other addresses, such as pods') in order of first appearance in the run,
  so a node's number can skip one taken by a pod's address seen before it.
- an account is `account-K`, counted apart.
Every pseudonym lies outside every shape above, so pseudonymising is idempotent: text the door
handed out, fed back into a later call, is not renamed again (and a replay, which re-cleans
argv built from recorded text, sees the same key).

Where the mapping lives, and why there: NOT in the run directory. It holds the very addresses
and accounts being hidden, and everything under results/<run>/ is sealed, committed and
published (and lib/publish/scan.py reads the book built from it). A run is many processes (one
kernel per notebook), so an in-memory table would number the same node differently in 00 and
04; a keyed hash would need its key kept somewhere just as private, and a key beside the
evidence would let anyone test the 2^24 private addresses against the pseudonyms. So the table
is kept outside the repository, in the recording user's state directory
(`$REPRO_IDENTITIES_DIR`, else `$XDG_STATE_HOME/deepep-guide/identities`, else
`~/.local/state/deepep-guide/identities`), one file per run directory (named by a hash of its
path), mode 0600, written only once an identity is seen (a table untouched for 30 days is
dropped when a new one is made). A replay never needs it: it answers from the recorded, already
pseudonymised text. Losing it costs only the numbering's continuity for stages recorded later
into the same run; it never leaks and never changes what was written.

Limits, by design: a four-part version printed bare inside a private range (`pip list`'s
`nvidia-curand-cu12  10.3.5.147`) cannot be told from an address and is renamed (pinned with
`==` it is kept); `ip-10-1-2-3` after a word or a dash (`x-ip-10-1-2-3`) is left, as the scan
leaves it; an instance id outside an EC2 name (a node's providerID) is no identity here; a real
host literally named `node-3` in a run that also numbers a third EC2 host would share its name.

The table also lets the door put real values back where the world needs them (`reveal`): a
caller that got `node-0.ec2.internal` from `kubectl get nodes` and pins a pod to it must reach
the real node, so the door reveals argv, env, stdin, URLs and the files an argv names just
before they leave, and records the pseudonymised form.
"""
from __future__ import annotations

import fcntl
import hashlib
import ipaddress
import json
import os
import re
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

PRIVATE_NETWORKS = tuple(ipaddress.IPv4Network(net) for net in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
    "100.64.0.0/10",  # carrier-grade NAT: EKS pods and VPC peering hand these out
))
# The pseudonyms' addresses: RFC 5737's TEST-NET-2 and TEST-NET-3 (TEST-NET-1, 192.0.2.0/24,
# is the project's own test data). Beyond their 512 addresses a run's further ones are addr-K.
PSEUDONYM_BLOCKS = (ipaddress.IPv4Network("198.51.100.0/24"),
                    ipaddress.IPv4Network("203.0.113.0/24"))
HOST_PREFIX, ADDRESS_PREFIX, ACCOUNT_PREFIX = "node-", "addr-", "account-"


def _pinned_versions(path: Path) -> frozenset[str]:
    """The versions pins.yaml pins that have an address's shape (tensorrt 10.11.0.33): public
    facts, never a cluster's address. Read as text (the core reads no YAML of the roots'): every
    `version: A.B.C.D` line."""
    try:
        text = path.read_text()
    except OSError:
        return frozenset()
    return frozenset(re.findall(r"(?m)^\s*version:\s*[\"']?(\d{1,3}(?:\.\d{1,3}){3})[\"']?\s*$",
                                text))


# one source: the repository's pins.yaml, beside lib/
NOT_ADDRESSES = _pinned_versions(Path(__file__).resolve().parents[2] / "pins.yaml")
STATE_DIR_ENV = "REPRO_IDENTITIES_DIR"
STATE_MAX_AGE_S = 30 * 24 * 3600  # an untouched table is dropped when a new one is made

HOST, ACCOUNT = "host", "account"  # the two counters: machines (names and addresses), accounts

# ---- shapes (each finds an identity in the text as the world wrote it) -----------------------
# Standing alone: not after a word character or a dot, not before one or a further `.digit`, so
# 10.1.2.3.4, v10.1.2.3 and 1.10.1.2.3 are no address; not after `==`, `>=`, `~=`...: a pinned
# version (nvidia-curand-cu12==10.3.5.147) is no address either. A version printed bare (`pip
# list`'s column) cannot be told from an address and is renamed.
PRIVATE_IPV4 = re.compile(
    r"(?<![\w.])(?<![=<>~!]=)(?:10|172|192|100)\.\d{1,3}\.\d{1,3}\.\d{1,3}(?!\w|\.\d)")
# ip-10-1-2-3: EC2's name for the host at 10.1.2.3, alone or as the first label of a longer
# name (`ip-10-1-2-3.ec2.internal`); never ip-10-1-2-3-4, nor after a word or a dash
# (`slip-10-1-2-3`): a pseudonym `node-K` is turned back only where it stands alone too, so that
# `composed-node-0` (a test double's host) is never taken for one.
EC2_IP_NAME = re.compile(r"(?<![\w-])ip-(\d{1,3})-(\d{1,3})-(\d{1,3})-(\d{1,3})(?!\w|-\d)")
# The first label of any other EC2 internal name (i-0123456789abcdef0.us-west-2.compute.internal).
EC2_INTERNAL_NAME = re.compile(r"(?<![\w.-])([a-z0-9][a-z0-9-]*)"
                               r"(?=(?:\.[a-z0-9-]+)?\.(?:compute|ec2)\.internal(?![\w-]|\.\w))")
_ARN_ACCOUNT = re.compile(r"(?<!\w)(arn:aws[\w-]*:[\w-]*:[\w-]*:)(\d{12})(?=:)")
_ECR_ACCOUNT = re.compile(
    r"(?<![\w.-])()(\d{12})(?=\.dkr\.ecr(?:-fips)?\.[a-z0-9-]+\.amazonaws\.com)")
_KEYED_ACCOUNT = re.compile(
    r"""(?i)(?<![a-z])(account(?:[_ -]?id)?[\s"'`\\]*[:=]?[\s"'`\\]*)(\d{12})(?!\d)""")
ACCOUNT_SHAPES = (_ARN_ACCOUNT, _ECR_ACCOUNT, _KEYED_ACCOUNT)  # group 2 is the account
_ACCOUNT_HINTS = (("arn:aws",), (".dkr.ecr",), ("ccount", "CCOUNT"))  # one is in every match

# ---- pseudonyms (what `reveal` turns back) ----------------------------------------------------
_PSEUDO_ADDRESS = re.compile(
    r"(?<![\w.])(198\.51\.100|203\.0\.113)\.(\d{1,3})(?!\w|\.\d)|(?<![\w-])addr-(\d+)(?!\w)")
_PSEUDO_HOST = re.compile(r"(?<![\w-])node-(\d+)(?!\w|-\d)")
_PSEUDO_ACCOUNT = re.compile(r"(?<![\w-])account-(\d+)(?!\w)")
# In a recorded text, what each kind of identity of a live text must have become.
_PSEUDONYM_OF = {
    "address": r"(?:198\.51\.100\.\d{1,3}|203\.0\.113\.\d{1,3}|addr-\d+)",
    "host": r"node-\d+",
    "account": r"account-\d+",
}

Span = tuple[int, int, str, str, str]  # start, end, form (address|host|account), counter, key


def is_private(address: str) -> bool:
    try:
        ip = ipaddress.IPv4Address(address)
    except ValueError:  # an octet over 255 or a leading zero: not an address
        return False
    return any(ip in net for net in PRIVATE_NETWORKS)


def address_pseudonym(k: int) -> str:
    for block in PSEUDONYM_BLOCKS:
        if k < block.num_addresses:
            return str(block.network_address + k)
        k -= block.num_addresses
    return f"{ADDRESS_PREFIX}{k + sum(b.num_addresses for b in PSEUDONYM_BLOCKS)}"


def _address_index(match: re.Match) -> int | None:
    if match.group(3) is not None:
        return int(match.group(3))
    last = int(match.group(2))
    if last > 255:
        return None
    return last + (0 if match.group(1) == "198.51.100" else 256)


def spans(text: str) -> list[Span]:
    """Every identity in `text`, in order, none overlapping: (start, end, form, counter, key).
    The key is what numbers it: an address and EC2's `ip-` name of it share the key (the
    dotted address); another EC2 name's key is its label; an account's is its digits."""
    found: list[Span] = []
    for shape, hints in zip(ACCOUNT_SHAPES, _ACCOUNT_HINTS):
        if any(hint in text for hint in hints):  # a literal first: megabytes of log are read fast
            for m in shape.finditer(text):
                found.append((m.start(2), m.end(2), "account", ACCOUNT, m.group(2)))
    for m in EC2_IP_NAME.finditer(text) if "ip-" in text else ():
        octets = m.groups()
        if all(int(o) <= 255 and (o == "0" or not o.startswith("0")) for o in octets):
            found.append((m.start(), m.end(), "host", HOST, ".".join(octets)))
    for m in EC2_INTERNAL_NAME.finditer(text) if ".internal" in text else ():
        label = m.group(1)
        if EC2_IP_NAME.fullmatch(label) or _PSEUDO_HOST.fullmatch(label):
            continue  # an ip- name (above), or a pseudonym already
        found.append((m.start(1), m.end(1), "host", HOST, "name:" + label))
    for m in PRIVATE_IPV4.finditer(text):
        if is_private(m.group()) and m.group() not in NOT_ADDRESSES:
            found.append((m.start(), m.end(), "address", HOST, m.group()))
    found.sort(key=lambda s: (s[0], -s[1]))
    kept: list[Span] = []
    for span in found:
        if not kept or span[0] >= kept[-1][1]:
            kept.append(span)
    return kept


def _pseudonym(form: str, k: int) -> str:
    if form == "address":
        return address_pseudonym(k)
    return f"{HOST_PREFIX if form == 'host' else ACCOUNT_PREFIX}{k}"


def _rewrite(text: str, index_of: Callable[[str, str], int | None]) -> str:
    """`text` with every identity replaced by its pseudonym; index_of(counter, key) numbers it
    (None: the identity stays as it is)."""
    if not text:
        return text
    found = spans(text)
    if not found:
        return text
    out, at = [], 0
    for start, end, form, counter, key in found:
        out.append(text[at:start])
        k = index_of(counter, key)
        out.append(text[start:end] if k is None else _pseudonym(form, k))
        at = end
    out.append(text[at:])
    return "".join(out)


def state_dir() -> Path:
    given = os.environ.get(STATE_DIR_ENV)
    if given:
        return Path(given)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "deepep-guide" / "identities"


def table_path(run_dir: Path) -> Path:
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:32]
    return state_dir() / f"{digest}.json"


class Identities:
    """One run's table: counter -> keys in order of first appearance (index = K). Kept at
    `path` (outside the run; see the module's docstring) and re-read before each new entry,
    so the processes of one run (a kernel per notebook) number alike."""

    def __init__(self, path: Path | None):
        self.path = Path(path) if path else None
        self._keys: dict[str, list[str]] = {HOST: [], ACCOUNT: []}
        self._index: dict[str, dict[str, int]] = {HOST: {}, ACCOUNT: {}}
        self._warned = False
        self._load()

    @classmethod
    def for_run(cls, run_dir: Path) -> "Identities":
        try:
            return cls(table_path(run_dir))
        except (OSError, RuntimeError, KeyError):  # no home folder to keep it in
            return cls(None)

    def __bool__(self) -> bool:
        return any(self._keys.values())

    # ---- the table ----------------------------------------------------------------------------
    def _set(self, data: dict) -> None:
        for counter in (HOST, ACCOUNT):
            keys = [str(k) for k in data.get(counter, [])]
            mine = self._keys[counter]
            if keys[:len(mine)] != mine:  # another writer's table: never renumber what was given
                continue
            self._keys[counter] = keys
            self._index[counter] = {k: i for i, k in enumerate(keys)}

    def _load(self) -> None:
        if self.path is None:
            return
        try:
            self._set(json.loads(self.path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            pass

    def index(self, counter: str, key: str) -> int:
        """K of `key`, numbering it (and writing the table) the first time it is seen."""
        known = self._index[counter].get(key)
        if known is not None:
            return known
        if self.path is not None:
            try:
                return self._add_persisted(counter, key)
            except OSError as exc:
                if not self._warned:
                    warnings.warn(f"identities table {self.path} unusable ({exc}): pseudonyms "
                                  "are numbered in this process only", stacklevel=2)
                    self._warned = True
                self.path = None
                known = self._index[counter].get(key)
                if known is not None:  # numbered before the write failed
                    return known
        return self._append(counter, key)

    def _append(self, counter: str, key: str) -> int:
        self._keys[counter].append(key)
        self._index[counter][key] = len(self._keys[counter]) - 1
        return self._index[counter][key]

    def _add_persisted(self, counter: str, key: str) -> int:
        folder = self.path.parent
        if not folder.exists():
            folder.mkdir(parents=True, mode=0o700, exist_ok=True)
            os.chmod(folder, 0o700)
        with open(folder / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not self.path.exists():
                _drop_stale(folder)
            self._load()  # another process of the run may have numbered more meanwhile
            known = self._index[counter].get(key)
            if known is not None:
                return known
            k = self._append(counter, key)
            data = {HOST: self._keys[HOST], ACCOUNT: self._keys[ACCOUNT]}
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".table-")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as fh:  # mkstemp: mode 0600
                    json.dump(data, fh)
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            return k

    # ---- the two directions -------------------------------------------------------------------
    def pseudonymise(self, text: str) -> str:
        """The text with every identity replaced by this run's pseudonym of it."""
        return _rewrite(text, self.index)

    def reveal(self, text: str) -> str:
        """The text with this run's pseudonyms replaced by the real values (for the world);
        a pseudonym-shaped word the table does not hold stays as it is."""
        if not text or not any(p in text for p in ("node-", "198.51.100.", "203.0.113.",
                                                   "addr-", "account-")):
            return text
        if not self._covers(text):
            self._load()  # numbered by another process of the run (an earlier stage)
        return _PSEUDO_ACCOUNT.sub(self._real_account, _PSEUDO_HOST.sub(
            self._real_host, _PSEUDO_ADDRESS.sub(self._real_address, text)))

    def _covers(self, text: str) -> bool:
        hosts, accounts = len(self._keys[HOST]), len(self._keys[ACCOUNT])
        return (all(int(m.group(1)) < hosts for m in _PSEUDO_HOST.finditer(text))
                and all(int(m.group(1)) < accounts for m in _PSEUDO_ACCOUNT.finditer(text))
                and all((_address_index(m) or 0) < hosts for m in _PSEUDO_ADDRESS.finditer(text)))

    def _key(self, counter: str, k: int | None) -> str | None:
        keys = self._keys[counter]
        return keys[k] if k is not None and 0 <= k < len(keys) else None

    def _real_address(self, m: re.Match) -> str:
        key = self._key(HOST, _address_index(m))
        return key if key and not key.startswith("name:") else m.group()

    def _real_host(self, m: re.Match) -> str:
        key = self._key(HOST, int(m.group(1)))
        if key is None:
            return m.group()
        return key[len("name:"):] if key.startswith("name:") else "ip-" + key.replace(".", "-")

    def _real_account(self, m: re.Match) -> str:
        return self._key(ACCOUNT, int(m.group(1))) or m.group()


def _drop_stale(folder: Path) -> None:
    """Tables untouched for STATE_MAX_AGE_S: their runs are long recorded (best effort)."""
    cutoff = time.time() - STATE_MAX_AGE_S
    for old in folder.glob("*.json"):
        try:
            if old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:
            pass


# ---- replay: a live key (identities raw) against a recorded one (pseudonymised) ---------------
class Bindings:
    """What a replay learned: each raw identity of the code's calls stands for one recorded
    pseudonym, and each pseudonym for one identity (a consistent renaming, nothing more)."""

    def __init__(self):
        self.to_k: dict[tuple[str, str], int] = {}
        self.to_key: dict[tuple[str, int], str] = {}

    def copy(self) -> "Bindings":
        other = Bindings()
        other.to_k, other.to_key = dict(self.to_k), dict(self.to_key)
        return other

    def bind(self, counter: str, key: str, k: int) -> bool:
        have, owner = self.to_k.get((counter, key)), self.to_key.get((counter, k))
        if (have is not None and have != k) or (owner is not None and owner != key):
            return False
        self.to_k[(counter, key)], self.to_key[(counter, k)] = k, key
        return True

    def index(self, counter: str, key: str) -> int | None:
        return self.to_k.get((counter, key))

    def __bool__(self) -> bool:
        return bool(self.to_k)


def _recorded_index(form: str, pseudonym: str) -> int:
    if form == "address":
        m = _PSEUDO_ADDRESS.fullmatch(pseudonym)
        return _address_index(m) if m else -1
    return int(pseudonym.rsplit("-", 1)[1])


def unify(recorded: str, live: str, bindings: Bindings) -> bool:
    """Does `recorded` say `live` with each identity of `live` renamed consistently (extending
    `bindings`)? Everything between the identities must be equal."""
    found = spans(live)
    if not found:
        return False
    pattern, at = [], 0
    for start, end, form, _counter, _key in found:
        pattern.append(re.escape(live[at:start]))
        pattern.append(f"({_PSEUDONYM_OF[form]})")
        at = end
    pattern.append(re.escape(live[at:]))
    m = re.fullmatch("".join(pattern), recorded)
    if not m:
        return False
    for (start, end, form, counter, key), pseudonym in zip(found, m.groups()):
        k = _recorded_index(form, pseudonym)
        if k is None or k < 0 or not bindings.bind(counter, key, k):
            return False
    return True


def as_recorded(live: str, bindings: Bindings) -> str:
    """`live` in the recorded pseudonyms, after `unify` bound its identities (an identity bound
    to none, as in a transcript recorded before pseudonyms, stays as it is)."""
    return _rewrite(live, bindings.index) if bindings else live
