"""Cluster identities through the real door: private addresses, EC2 host names and AWS account
ids are pseudonymised in argv, env, output, logs and URLs before anything is written, the same
identity always under the same pseudonym within a run (across processes too), while what leaves
for the world is the real value; loopback and the project's test addresses stay as they are; a
replay sees the recorded pseudonyms. Real processes (sh, a Python interpreter, http.server)."""
from __future__ import annotations

import re

import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lib.core import evidence
from lib.core import identities as naming
from lib.core.door import REPO_ROOT, Door, ReplayMismatch, read_transcript

FIXTURES = REPO_ROOT.parent / "shared" / "fixtures"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/guide/deepep-v2-efa@sha256:" + "5e" * 32
RAW = ("10.1.2.3", "ip-10-1-2-3", "172.31.5.6", "10.9.8.7", "ip-10-9-8-7", "192.168.7.7",
       "123456789012")


@pytest.fixture(autouse=True)
def state(tmp_path, monkeypatch) -> Path:
    """Each test's own table folder, outside its run (as the user's state folder is)."""
    folder = tmp_path / "state"
    monkeypatch.setenv(naming.STATE_DIR_ENV, str(folder))
    return folder


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return tmp_path / "run"


def files_holding(root: Path, values) -> list[str]:
    """Every file under root whose bytes hold one of the values: `path: value`."""
    return [f"{p.relative_to(root)}: {v}" for p in sorted(root.rglob("*")) if p.is_file()
            for v in values if v.encode() in p.read_bytes()]


# ---- shapes --------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("ip-10-1-2-3", "node-0"),
    ("ip-10-1-2-3.ec2.internal", "node-0.ec2.internal"),
    ("ip-10-1-2-3.us-west-2.compute.internal", "node-0.us-west-2.compute.internal"),
    ("i-0123456789abcdef0.us-west-2.compute.internal", "node-0.us-west-2.compute.internal"),
    ("ip-10-1-2-3:4120:4120 [0] NCCL INFO Bootstrap", "node-0:4120:4120 [0] NCCL INFO Bootstrap"),
    ("tcp://10.1.2.3:29500", "tcp://198.51.100.0:29500"),
    ("NodeAddr=172.16.0.1 NodeHostName=ip-172-16-0-1", "NodeAddr=198.51.100.0 NodeHostName=node-0"),
    ("192.168.1.20 and 100.64.7.9", "198.51.100.0 and 198.51.100.1"),
    ("arn:aws:eks:us-east-1:123456789012:cluster/p5en",
     "arn:aws:eks:us-east-1:account-0:cluster/p5en"),
    ("arn:aws:iam::123456789012:role/x", "arn:aws:iam::account-0:role/x"),
    (IMAGE, "account-0" + IMAGE[12:]),
    ('{"Account": "123456789012"}', '{"Account": "account-0"}'),
])
def test_each_kind_of_identity_gets_its_pseudonym(text, expected):
    assert naming.Identities(None).pseudonymise(text) == expected


@pytest.mark.parametrize("text", [
    "127.0.0.1:8000", "0.0.0.0", "192.0.2.2 (local)", "8.8.8.8", "100.128.0.1", "172.15.0.1",
    "172.32.0.1", "10.256.1.1", "10.1.2.3.4", "v10.1.2.3", "1.10.1.2.3",
    "nvidia-curand-cu12==10.3.5.147", "slip-10-1-2-3", "ip-10-1-2-3-4", "composed-node-0",
    "123456789012 requests", "node-0.ec2.internal", "198.51.100.7", "account-3",
])
def test_loopback_public_test_addresses_versions_and_pseudonyms_stay(text):
    assert naming.Identities(None).pseudonymise(text) == text


def test_a_pinned_version_shaped_like_an_address_is_no_address_and_a_real_one_still_is():
    """tensorrt 10.11.0.33 (pins.yaml): a public fact, kept wherever it stands (a JSON value, a
    table cell); an address beside it is still renamed, and a 4-part version pins.yaml does not
    pin cannot be told from one (it is renamed, as a bare `pip list` column is)."""
    assert "10.11.0.33" in naming.NOT_ADDRESSES
    text = '"version": "10.11.0.33", leader 10.11.0.34, tensorrt 10.16.1.11'
    assert naming.Identities(None).pseudonymise(text) == \
        '"version": "10.11.0.33", leader 198.51.100.0, tensorrt 198.51.100.1'
    from lib.publish import scan  # the book's last check agrees: one finding, the address

    found = scan.find_in_text("pins: tensorrt 10.11.0.33, a node at 10.11.0.34\n", "page.md")
    assert [(f.line, f.kind) for f in found] == [(1, scan.PRIVATE_IPV4)]
    assert scan.find_in_text("tensorrt 10.11.0.33\n", "page.md") == []


def test_a_public_index_s_answer_keeps_its_versions_and_still_masks_a_secret(run_dir):
    """door.http(public_response=True): a real HTTP server on 127.0.0.1 answers with dotted
    versions and a planted token; the recorded body keeps the versions and masks the token."""
    import http.server
    import threading

    token = "hf_" + "q" * 34
    body = json.dumps({"releases": {"10.16.1.11": [], "10.11.0.33": []}, "echo": token}).encode()

    class Answer(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        door = Door(run_dir, "01_public_roots")
        url = f"http://127.0.0.1:{server.server_port}/pypi/tensorrt/json"
        public = door.http("GET", url, timeout=10, headers={"Authorization": f"Bearer {token}"},
                           public_response=True)
        plain = door.http("GET", url, timeout=10, headers={"Authorization": f"Bearer {token}"})
    finally:
        server.shutdown()
    assert "10.16.1.11" in public.body and token not in public.body
    assert "10.16.1.11" not in plain.body and token not in plain.body  # the default renames it
    recorded = (run_dir / "calls" / "01_public_roots" / f"{public.seq:04d}.body").read_text()
    assert "10.16.1.11" in recorded and token not in recorded


def test_a_host_and_its_address_share_a_number_and_pseudonyms_are_fixed_points():
    table = naming.Identities(None)
    world = ("pod 10.244.0.7 then node ip-10-1-2-3.ec2.internal at 10.1.2.3; "
             "node ip-10-1-2-4 at 10.1.2.4; arn:aws:iam::123456789012:role/r")
    named = table.pseudonymise(world)
    assert named == ("pod 198.51.100.0 then node node-1.ec2.internal at 198.51.100.1; "
                     "node node-2 at 198.51.100.2; arn:aws:iam::account-0:role/r")
    assert table.pseudonymise(named) == named  # what the door handed out is not renamed again
    assert table.reveal(named) == world
    # a pseudonym-shaped word the table does not hold is left to the world as it is
    assert table.reveal("node-9 198.51.100.9 account-4 composed-node-1") == (
        "node-9 198.51.100.9 account-4 composed-node-1")


def test_past_the_documentation_blocks_addresses_are_named_addr_k():
    table = naming.Identities(None)
    text = " ".join(f"10.0.{k // 256}.{k % 256}" for k in range(513))
    named = table.pseudonymise(text).split()
    assert named[0] == "198.51.100.0" and named[255] == "198.51.100.255"
    assert named[256] == "203.0.113.0" and named[511] == "203.0.113.255"
    assert named[512] == "addr-512"
    assert table.reveal(" ".join(named)) == text


PRIVATE_V4 = re.compile(r"(?<![\d.])(?:10\.\d{1,3}|192\.168|172\.(?:1[6-9]|2\d|3[01]))"
                        r"\.\d{1,3}\.\d{1,3}(?![\d.])")


def test_the_shared_fixtures_pass_unchanged_but_for_their_private_addresses():
    """The fixtures are real vLLM, DeepEP, AIPerf, TensorRT-LLM and llm-d output. Most hold no
    private address, EC2 name or account and come out byte for byte; the public reproduction's
    cluster records (added to shared/ on 2026-12-03: its TensorRT-LLM seam logs name their
    rendezvous 10.240.x, its llm-d smoke log a pod IP) have exactly their private addresses
    renamed, reversibly. They also hold the project's own test address (192.0.2.2, vLLM's
    mq_connect_ip) and loopback, which must stay."""
    files = sorted(p for p in FIXTURES.rglob("*") if p.is_file())
    assert len(files) > 50, f"fixtures missing at {FIXTURES}"
    table = naming.Identities(None)
    texts = {p: p.read_text(errors="replace") for p in files}
    named = {p: table.pseudonymise(text) for p, text in texts.items()}
    changed = [p for p in files if named[p] != texts[p]]
    assert changed == [p for p in files if PRIVATE_V4.search(texts[p])]
    for p in changed:
        assert not PRIVATE_V4.search(named[p]), p
        assert table.reveal(named[p]) == texts[p], p
    assert any("mq_connect_ip=192.0.2.2" in t for t in texts.values())
    assert any("127.0.0.1" in t for t in texts.values())
    assert bool(table) == bool(changed)  # numbered only what it renamed


# ---- through the real door -----------------------------------------------------------------
def test_argv_env_and_output_of_real_calls_are_pseudonymised_consistently(run_dir):
    door = Door(run_dir, "00_cluster")
    first = door.run(["sh", "-c", 'echo "node $1 at $2"; echo "peer $GUIDE_PEER"; '
                                  'echo "loopback 127.0.0.1, test 192.0.2.2"',
                      "sh", "ip-10-1-2-3.ec2.internal", "10.1.2.3"],
                     timeout=10, env={"GUIDE_PEER": "172.31.5.6"})
    assert first.argv[-2:] == ["node-0.ec2.internal", "198.51.100.0"]
    assert first.stdout == ("node node-0.ec2.internal at 198.51.100.0\npeer 198.51.100.1\n"
                            "loopback 127.0.0.1, test 192.0.2.2\n")
    # the same host by another name and its address: the same number; a new host: a new one
    second = door.run(["sh", "-c", 'echo "$1 again at $2; new ip-10-9-8-7"', "sh",
                       "ip-10-1-2-3", "10.1.2.3"], timeout=10)
    assert second.stdout == "node-0 again at 198.51.100.0; new node-2\n"
    e1, e2 = read_transcript(run_dir / "transcript.jsonl")
    assert e1["key"] == first.argv and e1["env"] == {"GUIDE_PEER": "198.51.100.1"}
    assert e2["key"][-2:] == ["node-0", "198.51.100.0"]
    assert (run_dir / e1["stdout"]).read_text() == first.stdout
    evidence.seal(run_dir)
    assert files_holding(run_dir, RAW) == []


def test_another_process_of_the_run_numbers_alike_and_the_table_lives_outside_it(run_dir, state):
    """A run is a kernel per notebook: 03 in its own process names 00's node as 00 did."""
    Door(run_dir, "00_cluster").run(["echo", "ip-10-1-2-3 10.1.2.3 ip-10-9-8-7"], timeout=10)
    code = ("import sys\nfrom lib.core.door import Door\n"
            "d = Door(sys.argv[1], '03_kernel_test')\n"
            "print(d.run(['echo', 'ip-10-9-8-7 10.1.2.3 192.168.7.7'], timeout=10).stdout, end='')")
    done = subprocess.run([sys.executable, "-c", code, str(run_dir)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "node-1 198.51.100.0 198.51.100.2\n"
    # the table: one file, private, outside the run and the repository, holding the real values
    [table] = state.glob("*.json")
    assert table == naming.table_path(run_dir)
    assert stat.S_IMODE(table.stat().st_mode) == 0o600
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert json.loads(table.read_text())["host"] == ["10.1.2.3", "10.9.8.7", "192.168.7.7"]
    assert not table.is_relative_to(run_dir) and not table.is_relative_to(REPO_ROOT)
    evidence.seal(run_dir)
    assert files_holding(run_dir, RAW) == []


def test_the_default_table_folder_is_the_users_state_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(naming.STATE_DIR_ENV)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert naming.state_dir() == tmp_path / "xdg" / "deepep-guide" / "identities"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert naming.state_dir() == Path.home() / ".local" / "state" / "deepep-guide" / "identities"
    assert not naming.state_dir().is_relative_to(REPO_ROOT)


def test_an_unusable_table_folder_still_pseudonymises_in_the_process(run_dir, monkeypatch,
                                                                     tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(naming.STATE_DIR_ENV, str(blocker / "identities"))
    door = Door(run_dir, "00_cluster")
    with pytest.warns(UserWarning, match="numbered in this process only"):
        out = door.run(["echo", "10.1.2.3 ip-10-1-2-3 10.9.8.7"], timeout=10).stdout
    assert out == "198.51.100.0 node-0 198.51.100.1\n"
    assert files_holding(run_dir, RAW) == []


def test_what_leaves_for_the_world_is_the_real_value(run_dir, tmp_path):
    """The caller holds pseudonyms only; the process gets the real host in its argv, env, stdin
    and in a file of the run its argv names (a manifest pinned to the node), and what it prints
    is pseudonymised again. The evidence keeps the pseudonyms; the revealed copy is gone."""
    door = Door(run_dir, "00_cluster")
    [node] = door.run(["echo", "ip-10-1-2-3.ec2.internal"], timeout=10).stdout.split()
    assert node == "node-0.ec2.internal"
    manifest = run_dir / "00_cluster" / "manifests" / "node-probes.yaml"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(f"spec:\n  nodeName: {node}\n  other: composed-node-0 node-7\n")
    seen = tmp_path / "seen-by-the-process.txt"  # outside the run: what the world received
    result = door.run(
        ["sh", "-c", 'echo "argv $1 env $GUIDE_NODE_ADDR" > "$2"; cat "$3" >> "$2"; '
                     'cat >> "$2"; cat "$2"', "sh", node, str(seen), str(manifest)],
        timeout=10, env={"GUIDE_NODE_ADDR": "198.51.100.0"}, input="stdin node-0\n")
    assert seen.read_text() == ("argv ip-10-1-2-3.ec2.internal env 10.1.2.3\n"
                                "spec:\n  nodeName: ip-10-1-2-3.ec2.internal\n"
                                "  other: composed-node-0 node-7\n"
                                "stdin ip-10-1-2-3\n")
    assert result.stdout == ("argv node-0.ec2.internal env 198.51.100.0\n"
                             f"spec:\n  nodeName: {node}\n  other: composed-node-0 node-7\n"
                             "stdin node-0\n")
    entry = read_transcript(run_dir / "transcript.jsonl")[-1]
    assert entry["key"][-1] == "{run}/00_cluster/manifests/node-probes.yaml"
    assert entry["env"] == {"GUIDE_NODE_ADDR": "198.51.100.0"}
    assert manifest.read_text().startswith("spec:\n  nodeName: node-0.ec2.internal")
    assert door._private is not None and list(door._private.rglob("*")) == []
    assert files_holding(run_dir, RAW) == []


def test_a_server_its_log_and_http_keep_loopback_and_pseudonymise_the_rest(run_dir, tmp_path):
    """A real HTTP server on 127.0.0.1 (the local context's servers): reached as it is; what it
    serves and logs, and the URL recorded, name the cluster's hosts by pseudonym only."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "peers.txt").write_text("leader ip-10-1-2-3 at 10.1.2.3, worker 10.9.8.7\n")
    door = Door(run_dir, "04_serve")
    port = door.free_port()
    log = run_dir / "04_serve" / "server.log"
    server = door.start([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                         "--directory", str(site)], log_path=log)
    try:
        for _ in range(100):
            got = door.http("GET", f"http://127.0.0.1:{port}/peers.txt?from=10.1.2.3",
                            timeout=2)
            if got.status == 200:
                break
            door.sleep(0.1)
    finally:
        door.stop(server)
    assert got.body == "leader node-0 at 198.51.100.0, worker 198.51.100.1\n"
    http = [e for e in read_transcript(run_dir / "transcript.jsonl") if e["kind"] == "http"]
    assert http[-1]["key"]["url"] == f"http://127.0.0.1:{port}/peers.txt?from=198.51.100.0"
    logged = log.read_text()
    assert "GET /peers.txt?from=198.51.100.0" in logged and "127.0.0.1" in logged
    evidence.seal(run_dir)
    assert files_holding(run_dir, RAW) == []


# ---- replay --------------------------------------------------------------------------------
def record_and_copy(run_dir, tmp_path) -> tuple[list, Path]:
    door = Door(run_dir, "04_serve")
    [node] = door.run(["echo", "ip-10-1-2-3.ec2.internal"], timeout=10).stdout.split()
    applied = door.run(["echo", "--node", node, "--image", IMAGE], timeout=10)
    again = door.run(["echo", "--image", IMAGE], timeout=10)
    copy = tmp_path / "copy" / run_dir.name
    shutil.copytree(run_dir, copy)
    return [applied, again], copy


def test_a_replay_sees_the_pseudonymised_text_it_recorded(run_dir, tmp_path, state):
    (applied, again), copy = record_and_copy(run_dir, tmp_path)
    assert applied.argv == ["echo", "--node", "node-0.ec2.internal", "--image",
                            "account-0" + IMAGE[12:]]
    assert applied.stdout == f"--node node-0.ec2.internal --image account-0{IMAGE[12:]}\n"
    shutil.rmtree(state)  # a replay elsewhere: no table, only the recorded run
    replay = Door(copy, "04_serve", replay=True)
    [node] = replay.run(["echo", "ip-10-1-2-3.ec2.internal"], timeout=10).stdout.split()
    assert node == "node-0.ec2.internal"  # the recorded text, as the record handed it out
    # the node came from the transcript; the image is a parameter, its account id raw here
    replayed = replay.run(["echo", "--node", node, "--image", IMAGE], timeout=10)
    assert (replayed.argv, replayed.stdout) == (applied.argv, applied.stdout)
    assert replay.run(["echo", "--image", IMAGE], timeout=10).stdout == again.stdout
    assert replay.remaining() == 0
    assert not state.exists()  # a replay writes no table


def test_a_replay_refuses_an_inconsistent_renaming(run_dir, tmp_path):
    _, copy = record_and_copy(run_dir, tmp_path)
    replay = Door(copy, "04_serve", replay=True)
    [node] = replay.run(["echo", "ip-10-1-2-3.ec2.internal"], timeout=10).stdout.split()
    replay.run(["echo", "--node", node, "--image", IMAGE], timeout=10)
    other = "210987654321" + IMAGE[12:]  # another account where the recording had account-0
    with pytest.raises(ReplayMismatch, match="call #2 differs"):
        replay.run(["echo", "--image", other], timeout=10)


@pytest.mark.parametrize("live", [
    ["echo", "--node", "ip-10-1-2-4.ec2.internal", "--image", IMAGE],  # another host, raw
    ["echo", "--node", "node-1.ec2.internal", "--image", IMAGE],  # another pseudonym
    ["echo", "--node", "node-0.ec2.internal", "--image", "registry.example/x@sha256:" + "5e" * 32],
])
def test_a_replay_refuses_a_different_identity_or_text(run_dir, tmp_path, live):
    _, copy = record_and_copy(run_dir, tmp_path)
    replay = Door(copy, "04_serve", replay=True)
    # the code passes the raw name the recording saw: node-0 now stands for 10.1.2.3 alone
    replay.run(["echo", "ip-10-1-2-3.ec2.internal"], timeout=10)
    with pytest.raises(ReplayMismatch, match="call #1 differs"):
        replay.run(live, timeout=10)


def test_a_transcript_recorded_before_pseudonyms_replays_as_recorded(run_dir, tmp_path, state):
    """A transcript holding raw addresses (a pod IP no pseudonym stands for): its replay hands
    the recorded text back and matches the raw values the code passes."""
    door = Door(run_dir, "04_serve")
    door.run(["echo", "plain"], timeout=10)
    copy = tmp_path / "copy" / run_dir.name
    shutil.copytree(run_dir, copy)
    transcript = copy / "transcript.jsonl"
    [entry] = read_transcript(transcript)
    entry["key"] = ["echo", "10.244.0.7"]
    transcript.write_text(json.dumps(entry, sort_keys=True) + "\n")
    (copy / entry["stdout"]).write_text("pod at 10.244.0.7\n")
    replay = Door(copy, "04_serve", replay=True)
    result = replay.run(["echo", "10.244.0.7"], timeout=10)
    assert (result.argv, result.stdout) == (["echo", "10.244.0.7"], "pod at 10.244.0.7\n")


# ---- what the stage writes beside the door (the edits proposed for lib/core/stage.py) ----------
def test_an_artifact_scrubbed_by_the_door_reaches_the_world_real_and_replays(run_dir, tmp_path):
    """A manifest made from a node the door named and an image given as a parameter: written
    through door.scrub it names both by pseudonym; `kubectl apply -f` (here cat) gets the real
    ones; a replay, whose code re-computes it with the raw image, finds it the same, and a
    manifest with another account is not."""
    door = Door(run_dir, "04_serve")
    [node] = door.run(["echo", "ip-10-1-2-3.ec2.internal"], timeout=10).stdout.split()
    live = f"nodeName: {node}\nimage: {IMAGE}\n"
    manifest = run_dir / "04_serve" / "manifests" / "vllm.yaml"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(door.scrub(live))
    assert manifest.read_text() == f"nodeName: node-0.ec2.internal\nimage: account-0{IMAGE[12:]}\n"
    applied = tmp_path / "applied.yaml"
    door.run(["sh", "-c", 'cat "$1" > "$2"', "sh", str(manifest), str(applied)], timeout=10)
    assert applied.read_text() == f"nodeName: ip-10-1-2-3.ec2.internal\nimage: {IMAGE}\n"
    copy = tmp_path / "copy" / run_dir.name
    shutil.copytree(run_dir, copy)
    replay = Door(copy, "04_serve", replay=True)
    [node] = replay.run(["echo", "ip-10-1-2-3.ec2.internal"], timeout=10).stdout.split()
    recorded = (copy / "04_serve" / "manifests" / "vllm.yaml").read_text()
    assert replay.same_as_recorded(recorded, f"nodeName: {node}\nimage: {IMAGE}\n")
    assert not replay.same_as_recorded(recorded, f"nodeName: {node}\nimage: 2{IMAGE[1:]}\n")
    assert not replay.same_as_recorded(recorded, f"nodeName: node-1.ec2.internal\nimage: {IMAGE}\n")


def test_redact_file_given_the_run_pseudonymises_with_the_runs_numbering(run_dir, tmp_path):
    """lib/runner.py's papermill log and sweep's AIPerf exports are files a process wrote:
    redact_file with the run names their hosts as the door did; without it, secrets only."""
    from lib.core.door import redact_file

    Door(run_dir, "00_cluster").run(["echo", "ip-10-1-2-3"], timeout=10)
    log = run_dir / "notebooks" / "04_serve.papermill.log"
    log.parent.mkdir(parents=True)
    log.write_text("rank 3 on ip-10-9-8-7, leader ip-10-1-2-3 (10.1.2.3)\n")
    assert not redact_file(log)
    assert redact_file(log, run_dir=run_dir)
    assert log.read_text() == "rank 3 on node-1, leader node-0 (198.51.100.0)\n"
