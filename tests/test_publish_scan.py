"""The scan that refuses to publish identities (lib/publish/scan.py): each kind planted in each
kind of published file is found at its path and line, masked; the near misses are not; a tree
holding one refuses naming each file; binary files are skipped; and what the project really
publishes (the theme's assets, the committed runs' notebooks and notes) scans clean."""
from __future__ import annotations

import glob
import html
import json
from pathlib import Path

import nbformat
import pytest
from PIL import Image, PngImagePlugin

from lib.core.door import REPO_ROOT
from lib.publish import scan
from lib.publish.scan import PublishRefused, find_identities, find_in_text, refuse_identities

# Planted values are built from pieces, so no key-shaped string sits in the repository.
HF = "hf_" + "Zq8" * 12
AKIA = "AKIA" + "Q7ZP3XK2M9W4T6R1"
AWS_SECRET = "wJalrXUtnFEMI" + "/K7MDENG/bPxRfiCY" + "EXAMPLEKEY"
SESSION = "FwoGZXIvYXdzE" + "Dk4aDOmT3q9k2Qm" * 6 + "=="
GHP = "ghp_" + "a1B2c3D4e5" * 3 + "F6g7H8"
GHO = "gho_" + "Z9y8X7w6V5" * 3 + "u4T3s2"
GITHUB_PAT = "github_pat_" + "11ABCDEFG0" + "_" + "xYz123" * 10
BEARER = "b7Ac9" + "Qe31kLm0" * 3
JWT = "eyJhbGciOiJIUzI1NiJ9" + ".eyJzdWIiOiJhbGljZSJ9" + ".Zm9vYmFyYmF6cXV4"
PASSWORD = "s3cret" + "Passw0rd"

# (kind, the planted line, what of it must never be republished)
PLANTED = [
    (scan.PRIVATE_IPV4, "node ready at 10.12.34.56 on port 8000", "10.12.34.56"),
    (scan.PRIVATE_IPV4, "NCCL_SOCKET_IFNAME=eth0 addr 172.31.200.17:29500", "172.31.200.17"),
    (scan.PRIVATE_IPV4, "gateway 192.168.100.254.", "192.168.100.254"),
    (scan.PRIVATE_IPV4, "pod IP (100.64.7.9)", "100.64.7.9"),
    (scan.EC2_HOST, "Node: ip-10-1-2-3.ec2.internal Ready", "ip-10-1-2-3"),
    (scan.EC2_HOST, "nodeName: ip-172-31-9-77.us-west-2.compute.internal", "ip-172-31-9-77"),
    (scan.EC2_HOST, "hostname ip-10-0-5-19", "ip-10-0-5-19"),
    (scan.AWS_ACCOUNT_ID, "role arn:aws:iam::381234567890:role/eks-node", "381234567890"),
    (scan.AWS_ACCOUNT_ID, "image 381234567890.dkr.ecr.us-east-1.amazonaws.com/deepep:v2",
     "381234567890"),
    (scan.AWS_ACCOUNT_ID, '{"Account": "381234567890", "UserId": "x"}', "381234567890"),
    (scan.AWS_ACCOUNT_ID, "AWS_ACCOUNT_ID=381234567890", "381234567890"),
    (scan.AWS_ACCOUNT_ID, "aws_account_id: 381234567890", "381234567890"),
    (scan.HF_TOKEN, f"login with {HF} done", HF),
    (scan.AWS_ACCESS_KEY_ID, f"aws_access_key_id = {AKIA}", AKIA),
    (scan.AWS_SECRET_ACCESS_KEY, f"AWS_SECRET_ACCESS_KEY={AWS_SECRET}", AWS_SECRET),
    (scan.AWS_SECRET_ACCESS_KEY, f'"SecretAccessKey": "{AWS_SECRET}",', AWS_SECRET),
    (scan.AWS_SESSION_TOKEN, f"aws_session_token = {SESSION}", SESSION),
    (scan.AWS_SESSION_TOKEN, f"export AWS_SESSION_TOKEN={SESSION}", SESSION),
    (scan.GITHUB_TOKEN, f"git push with {GHP}", GHP),
    (scan.GITHUB_TOKEN, f"oauth {GHO}", GHO),
    (scan.GITHUB_TOKEN, f"GH_TOKEN={GITHUB_PAT}", GITHUB_PAT),
    (scan.BEARER_TOKEN, f"Authorization: Bearer {BEARER}", BEARER),
    (scan.JWT, f"id_token {JWT}", JWT),
    (scan.URL_PASSWORD, f"git clone https://deploy:{PASSWORD}@git.example.com/repo.git", PASSWORD),
    (scan.PERSONAL_PATH, "File /home/alice/.cache/hf/model.safetensors", "alice"),
    (scan.PERSONAL_PATH, "cwd=/Users/alice/src/guide", "alice"),
    (scan.PERSONAL_PATH, r"C:\Users\alice\AppData\Local\Temp", "alice"),
]
MARK = "PLANTED:"  # the planted line says so, so each format's expected line is found without scan


def as_txt(line: str) -> str:
    return f"a first line\n\n{line}\nthe end\n"


def as_html(line: str) -> str:
    return f"<html>\n<body>\n<p>intro</p>\n<pre>{html.escape(line)}</pre>\n</body>\n</html>\n"


def as_json(line: str) -> str:
    return json.dumps({"gate": "served", "observed": line, "status": "PASS"}, indent=2)


def as_ipynb(line: str) -> str:
    notebook = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("run(stage)")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"starting\n{line}\n")]
    notebook.cells = [nbformat.v4.new_markdown_cell("# 04_serve"), cell]
    return nbformat.writes(notebook)


FORMATS = {"page.html": as_html, "gates.json": as_json, "04_serve.ipynb": as_ipynb,
           "log.txt": as_txt}


def planted_tree(tmp_path: Path, name: str, line: str) -> tuple[Path, int]:
    """A file `name` under tmp_path/site/sub holding `line`; returns the root and its line."""
    text = FORMATS[name](f"{MARK} {line}")
    path = tmp_path / "site" / "sub" / name
    path.parent.mkdir(parents=True)
    path.write_text(text, encoding="utf-8")
    expected_line = next(n for n, text_line in enumerate(text.splitlines(), 1) if MARK in text_line)
    return tmp_path / "site", expected_line


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("kind, line, secret", PLANTED)
def test_each_kind_is_found_in_each_format_at_its_path_and_line_masked(tmp_path, name, kind,
                                                                       line, secret):
    root, expected_line = planted_tree(tmp_path, name, line)
    found = find_identities(root)
    assert [(f.path, f.line, f.kind) for f in found] == [(f"sub/{name}", expected_line, kind)]
    assert secret not in found[0].masked and found[0].masked.endswith("...")
    assert secret not in str(found[0])


@pytest.mark.parametrize("text", [
    "serving on 127.0.0.1:8000 and 127.10.20.30",  # loopback
    "listening on 0.0.0.0:8000",
    "resolver 8.8.8.8 and 1.1.1.1, public 54.239.28.85",
    "172.15.255.1 and 172.32.0.1 and 100.63.255.255 and 100.128.0.1 and 192.169.0.1",
    "cuda 10.2.3.4.5, nccl 1.10.1.2.3, v10.1.2.3, libfoo.so.10.1.2.3",  # versions, not addresses
    "10.256.1.1 and 010.1.2.3",  # an octet over 255, a leading zero
    "-13.47 10.1.9.34 1.17.81",  # SVG path data (the theme's icons): decimals, not an address
    "ip-999-1-2-3 and tooltip-10-1-2-3 and ip-10-1-2",
    "timestamp 1733051212000 counter 123456789012 and tokens: 381234567890",  # bare 12 digits
    "accounting 381234567890, Account: 12345678901234",
    "1381234567890.dkr.ecr.us-east-1.amazonaws.com",  # 13 digits: no account id
    "hf_abc123xyz and hf_hub_download and HF_HOME=/cache",  # hf_ with too few characters
    "AKIA123 and ASIAN food",
    "AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY} and secret_key: [REDACTED]",
    "commit 0123456789abcdef0123456789abcdef01234567",  # 40 hex characters with no name
    "aws_session_token: null, SessionTokenProviderImplementation",
    "HF_TOKEN=[REDACTED] and Authorization: Bearer [REDACTED]",
    "bearer authentication is used, Bearer EMPTY, bearer tokens are masked",
    "send Authorization: Bearer your-huggingface-access-token",  # a placeholder, not generated
    "https://oauth2:${GITHUB_TOKEN}@github.com/org/repo and git@github.com:org/repo.git",
    "ssh://git@host/repo and https://user:****@host and http://[::1]:8000/v1",
    "/home/ alone, /home/<user>/, /home/$USER/, https://example.com/home/page/",
    "/Users/Shared/ and C:\\Users\\Public\\ and ~/projects",
])
def test_near_misses_are_not_found(text):
    assert find_in_text(text) == []


def test_every_address_of_a_list_is_found_and_a_sentence_may_end_after_one():
    found = find_in_text("peers 10.0.0.1 10.0.0.2 10.0.0.3\nreached 192.168.1.20.\n")
    assert [(f.line, f.kind) for f in found] == [(1, scan.PRIVATE_IPV4)] * 3 + [
        (2, scan.PRIVATE_IPV4)]


def test_values_hidden_by_markup_are_found_as_a_reader_sees_them():
    """A highlighted code cell splits the name from its value into spans; a notebook's HTML
    output escapes the quotes between them."""
    page = (f'<pre><span class="nv">AWS_SECRET_ACCESS_KEY</span><span class="o">=</span>'
            f'<span class="s2">{AWS_SECRET}</span></pre>\n'
            f"<td>{{&quot;Account&quot;: &quot;381234567890&quot;}}</td>\n")
    found = find_in_text(page, "notebooks/04_serve.html")
    assert [(f.line, f.kind) for f in found] == [(1, scan.AWS_SECRET_ACCESS_KEY),
                                                 (2, scan.AWS_ACCOUNT_ID)]


def test_findings_are_listed_once_per_line_kind_and_value():
    text = f"arn:aws:iam::381234567890:role/x Account=381234567890\n{HF} {HF}\n\n{HF}\n"
    assert [(f.line, f.kind) for f in find_in_text(text)] == [
        (1, scan.AWS_ACCOUNT_ID), (2, scan.HF_TOKEN), (4, scan.HF_TOKEN)]


def test_masks_show_at_most_four_characters_and_a_third():
    assert scan.mask(HF) == "hf_Z..."
    assert scan.mask("10.0.0.5") == "10..."
    assert scan.mask("pw") == "..."


def test_binary_files_are_skipped_and_the_same_value_as_text_is_found(tmp_path):
    root = tmp_path / "site"
    (root / "_images").mkdir(parents=True)
    (root / "_static").mkdir()
    (root / "_static" / "font.woff2").write_bytes(b"wOF2\x00\x01" + HF.encode() + b"\x00")
    chunks = PngImagePlugin.PngInfo()
    chunks.add_text("Comment", f"{HF} at /home/alice/")  # a PNG's text chunk: still an image
    Image.new("RGB", (4, 4)).save(root / "_images" / "plot.png", pnginfo=chunks)
    Image.new("RGB", (300, 300)).save(root / "_images" / "photo.gif")
    # an image's signature is enough, NUL byte or not (a GIF 300 pixels wide has none there)
    (root / "_images" / "header.gif").write_bytes(b"GIF89a" + b"\x2c\x01" * 2 + HF.encode())
    assert HF.encode() in (root / "_images" / "plot.png").read_bytes()
    assert find_identities(root) == []
    refuse_identities(root)

    (root / "_static" / "notes.txt").write_text(f"{HF}\n")
    assert [(f.path, f.kind) for f in find_identities(root)] == [("_static/notes.txt",
                                                                 scan.HF_TOKEN)]


def test_a_clean_tree_passes_and_a_planted_one_is_refused_naming_each_file(tmp_path):
    root = tmp_path / "html"
    (root / "_sources" / "notebooks").mkdir(parents=True)
    (root / "index.html").write_text("<p>served on 127.0.0.1:8000, nccl 2.30.4</p>\n")
    (root / "_sources" / "notebooks" / "04_serve.ipynb").write_text(as_ipynb("ready"))
    refuse_identities(root)  # clean: returns, raising nothing

    (root / "index.html").write_text(f"<p>clean</p>\n<p>login {HF}</p>\n")
    (root / "_sources" / "notebooks" / "04_serve.ipynb").write_text(
        as_ipynb("node ip-10-1-2-3.ec2.internal at 10.1.2.3"))
    with pytest.raises(PublishRefused) as refused:
        refuse_identities(root)
    message = str(refused.value)
    assert "3 identities found" in message
    assert "  index.html:2 hf-token hf_Z..." in message
    notebook_line = next(n for n, line in enumerate(
        (root / "_sources" / "notebooks" / "04_serve.ipynb").read_text().splitlines(), 1)
        if "ip-10" in line)
    for kind in (scan.EC2_HOST, scan.PRIVATE_IPV4):
        assert f"  _sources/notebooks/04_serve.ipynb:{notebook_line} {kind} " in message
    assert HF not in message and "10.1.2.3" not in message
    assert [(f.path, f.kind) for f in refused.value.findings] == [  # in path order
        ("_sources/notebooks/04_serve.ipynb", scan.EC2_HOST),
        ("_sources/notebooks/04_serve.ipynb", scan.PRIVATE_IPV4), ("index.html", scan.HF_TOKEN)]


def test_a_long_refusal_lists_the_first_findings_and_counts_the_rest(tmp_path):
    peers = range(scan.REFUSAL_LINES + 7)
    (tmp_path / "log.txt").write_text("".join(f"peer 10.0.{n}.1\n" for n in peers))
    with pytest.raises(PublishRefused) as refused:
        refuse_identities(tmp_path)
    lines = str(refused.value).splitlines()
    assert len(refused.value.findings) == scan.REFUSAL_LINES + 7
    assert lines[-1] == "  ... and 7 more"
    assert sum(line.startswith("  log.txt:") for line in lines) == scan.REFUSAL_LINES


# ---- what the project really publishes ------------------------------------------------------
def theme_static_folders() -> list[Path]:
    """Where the book's _static comes from: the themes and extensions of _config.yml."""
    import myst_nb
    import pydata_sphinx_theme
    import sphinx
    import sphinx_book_theme

    return [Path(pydata_sphinx_theme.__file__).parent / "theme" / "pydata_sphinx_theme" / "static",
            Path(sphinx_book_theme.__file__).parent / "theme" / "sphinx_book_theme" / "static",
            Path(sphinx.__file__).parent / "themes" / "basic" / "static",
            Path(myst_nb.__file__).parent / "static"]


@pytest.mark.parametrize("folder", theme_static_folders(), ids=lambda p: p.parts[-2])
def test_the_themes_static_assets_scan_clean(folder):
    assert folder.is_dir()
    assert find_identities(folder) == []


def test_the_icons_svg_paths_hold_address_shaped_decimals_the_scan_passes():
    """Why the decimals rule exists: fontawesome.js really holds 10.1.9.34 between decimals."""
    icons = theme_static_folders()[0] / "scripts" / "fontawesome.js"
    text = icons.read_text(encoding="utf-8")
    assert "-13.47 10.1.9.34 1.17.81" in text
    assert find_in_text(text) == []


def test_the_committed_runs_notebooks_and_notes_scan_clean():
    published = sorted(glob.glob(str(REPO_ROOT / "results" / "*" / "notebooks" / "*.ipynb"))
                       + glob.glob(str(REPO_ROOT / "results" / "*.notes.md")))
    assert len(published) > 20
    findings = [finding for path in published
                for finding in find_in_text(scan.read_text(Path(path)),
                                            str(Path(path).relative_to(REPO_ROOT)))]
    assert findings == []
