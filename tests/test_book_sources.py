"""lib.publish.sources: every public source the book cites has a well-formed address, the linker
turns source names and project-qualified thread references into links without touching code or
existing links, and in the built book every sentence that says "cited" links its source and no
page names a file the repository does not hold."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from lib.measure import bounds, published
from lib.publish import sources

BLOB = re.compile(r"^/[^/]+/[^/]+/blob/[0-9a-f]{40}/.+")
THREAD = re.compile(r"^/[^/]+/[^/]+/(issues|pull)/\d+$")
REPO_PAGE = re.compile(r"^/[^/]+/[^/]+$")  # only where no file was read at a commit: "as found"
DATE = re.compile(r"^(\d{4}(-\d{2}){0,2}( \(.+\))?|as found \d{4}-\d{2}-\d{2}( \(.+\))?)$")


def link(text: str, source_id: str) -> str:
    return f"[{text}]({sources.url(source_id)})"


# ---- the sources -----------------------------------------------------------------------------

def test_every_source_has_a_title_a_date_and_a_well_formed_url():
    entries = sources.sources()
    assert len(entries) > 50
    for source_id, entry in entries.items():
        assert entry["title"].strip() and DATE.match(entry["date"]), (source_id, entry["date"])
        address = urlparse(entry["url"])
        assert address.scheme == "https" and address.netloc == "github.com", entry["url"]
        assert BLOB.match(address.path) or THREAD.match(address.path) or (
            REPO_PAGE.match(address.path) and entry["date"].startswith("as found")), (
            source_id, entry["url"])
        assert not address.query and not address.fragment, entry["url"]


def test_the_projects_name_repositories_and_each_name_one_source():
    data = yaml.safe_load(sources.SOURCES_PATH.read_text(encoding="utf-8"))
    for repo in data["projects"]:
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", repo), repo
    names = sources._names()  # raises where one phrase would name two sources
    assert names["antonai-work/deepep-v2-efa-repro RESULTS.md"] == sources.url("repro-results")


def test_every_cited_figure_names_a_listed_source():
    for entry in bounds.load_cited()["cited"]:
        assert sources.url(entry["source_id"]), entry["id"]
        assert "ANCHORS" not in entry["source"] and "../" not in entry["source"], entry["id"]
    for table in ("nvlink", "efa"):
        for name, entry in bounds.load_links()[table].items():
            assert "ANCHORS" not in entry["source"] and "../" not in entry["source"], name
            if entry.get("source_id"):
                assert sources.url(entry["source_id"]), name


def test_the_published_figures_name_their_source():
    assert sources.url(published.SOURCE_ID).endswith("/RESULTS.md")
    assert sources._names()[published.SOURCE] == sources.url(published.SOURCE_ID)


# ---- the linker ------------------------------------------------------------------------------

@pytest.mark.parametrize("said, linked", [
    ("vLLM #54281 reports it.", f"{link('vLLM #54281', 'vllm-54281')} reports it."),
    ("see vllm #27898", f"see {link('vllm #27898', 'vllm-27898')}"),
    ("DeepEP #612 is open", f"{link('DeepEP #612', 'deepep-612')} is open"),
    ("(aws-ofi-nccl #889)", f"({link('aws-ofi-nccl #889', 'ofi-889')})"),
    ("awsome-distributed-ai PR #1230, 2026-09-22",
     f"{link('awsome-distributed-ai PR #1230', 'aws-sample-1230')}, 2026-09-22"),
    ("uccl issue #926 (p5en)", f"{link('uccl issue #926', 'uccl-926')} (p5en)"),
    ("TensorRT-LLM's issues #17714/#17715 report it",
     f"{link(chr(39).join(['TensorRT-LLM', 's issues #17714']), 'trtllm-17714')}/"
     f"{link('#17715', 'trtllm-17715')} report it"),
    ("SGLang #29525", link("SGLang #29525", "sglang-29525")),
    ("kubernetes/kubernetes#96186 and #94020",
     f"{link('kubernetes/kubernetes#96186', 'k8s-96186')} and {link('#94020', 'k8s-94020')}"),
])
def test_a_project_qualified_reference_links_its_thread(said, linked):
    assert sources.link_references(said) == linked


def test_a_bare_number_takes_the_project_named_before_it_in_its_paragraph():
    said = "vLLM fixed it after 0.24.0 (#46408, #47785, #52632)."
    assert sources.link_references(said) == (
        f"vLLM fixed it after 0.24.0 ({link('#46408', 'vllm-46408')}, "
        f"{link('#47785', 'vllm-47785')}, {link('#52632', 'vllm-52632')}).")
    # of the projects named before it, the one whose thread it is (sources.yaml) wins
    said = "DeepEP b306af06, aws-ofi-nccl 9c44d34, the PR #612 trio"
    assert sources.link_references(said) == (
        f"DeepEP b306af06, aws-ofi-nccl 9c44d34, the {link('PR #612', 'deepep-612')} trio")
    # a new paragraph, or a new table row, forgets the project: a number alone stays text
    assert sources.link_references("vLLM, then\n\n#46408 alone") == "vLLM, then\n\n#46408 alone"
    assert sources.link_references("| vLLM | a |\n| b | #46408 |") == "| vLLM | a |\n| b | #46408 |"
    # a heading's hashes and a one-digit number are not threads
    assert sources.link_references("vLLM\n## 4. Then #1") == "vLLM\n## 4. Then #1"


def test_a_known_source_name_links_its_file_at_its_commit():
    said = "cited: antonai-work/deepep-v2-efa-repro RESULTS.md, 2026-07-06."
    assert sources.link_references(said) == (
        f"cited: {link('antonai-work/deepep-v2-efa-repro RESULTS.md', 'repro-results')}, "
        "2026-07-06.")
    said = "(antonai-work/deepep-v2-efa-repro, results/megatron-shapeY-20260505/VALIDATION.md)"
    assert sources.url("repro-megatron") in sources.link_references(said)
    # a cited figure's id names its source (the bounds tables' rows)
    assert sources.link_references("| repro-gate1-proxy | 1 |") == (
        f"| {link('repro-gate1-proxy', 'repro-t2-microbench')} | 1 |")
    # a name inside a longer word or path is not the name
    for inside in ("aws-sample-2026-09/vllm", "trtllm-0.21.0/torch",
                   "x/results/p5en_2n4n_20260825"):
        assert sources.link_references(inside) == inside


def test_code_links_and_markup_are_left_as_they_are():
    untouched = [
        "`vLLM #54281` and ``antonai-work/deepep-v2-efa-repro RESULTS.md``",
        "[vLLM #54281](https://example.org/x) and ![DeepEP #612](fig.png)",
        "[the reproduction](https://github.com/antonai-work/deepep-v2-efa-repro)",
        "{ref}`vLLM #54281 <fast>` and {doc}`DeepEP #612`",
        "<https://github.com/vllm-project/vllm/pull/41183> and https://x.org/vLLM#41183",
        "<!-- vLLM #54281 -->",
        "```{figure} a.png\nvLLM #54281\n```\n",
        "~~~\nDeepEP #612 antonai-work/deepep-v2-efa-repro RESULTS.md\n~~~\n",
        "  ```text\n  vLLM #54281\n  ```\n",
        "(wire)=\n## 4. How close",
        "text\n\n    vLLM #54281 in an indented code block\n",
        "- a list item\n\n      vLLM #54281 in its indented code block\n",
    ]
    for said in untouched:
        assert sources.link_references(said) == said, said
    # an unmatched backtick (a quoted log line) opens no code span past its paragraph
    said = "Assertion `-sizes[i] <= index failed.\n\nvLLM #54281"
    assert sources.link_references(said).endswith(link("vLLM #54281", "vllm-54281"))
    # a name wrapped across lines is still the name
    assert sources.link_references("R's\n  trtllm/README.md") == (
        f"[R's\n  trtllm/README.md]({sources.url('repro-trtllm')})")
    # text around them still links, once
    said = "`x` vLLM #54281 [y](z)"
    once = sources.link_references(said)
    assert once == f"`x` {link('vLLM #54281', 'vllm-54281')} [y](z)"
    assert sources.link_references(once) == once  # never a link inside a link


def test_strip_links_gives_back_the_text_the_links_were_made_from():
    said = ("| vLLM | fixes (#46408, #47785); cited: antonai-work/deepep-v2-efa-repro RESULTS.md |"
            " `vLLM #1` [a run](runs/x.md)")
    assert sources.strip_links(sources.link_references(said)) == said


def test_md_link_and_url():
    assert sources.md_link("RESULTS.md", "repro-results") == link("RESULTS.md", "repro-results")
    with pytest.raises(KeyError, match="no source 'nowhere'"):
        sources.url("nowhere")


def test_the_comparison_section_of_transport_figures():
    section = sources.comparison_efa_section()
    table = sources.efa_transport_figures()
    assert set(table["level"]) == {"cited"} and table["date"].str.len().gt(0).all()
    for source_id in table["source_id"].unique():
        assert f"]({sources.url(source_id)})" in section
    # each "cited" sentence of the section links its source
    for sentence in re.split(r"(?<=\.)\s+", section):
        if re.search(r"\bcited\b", sentence, re.I):
            assert "](https://" in sentence, sentence
    # the p5en rows are the cited figures of the bounds page, and their ratio is computed
    assert "| 2 | 128 | dispatch | 365.1 | 169.4 | 2.16 |" in section
    assert "| 4 | 128 | dispatch | 1003.2 | 184.3 | 5.44 |" in section
    assert "| 64 | 351.1 | 341.9 | 1.027 |" in section


# ---- the built book --------------------------------------------------------------------------

BLOCKS = ("p", "li", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "figcaption",
          "caption", "th", "td")
# the end of a sentence: a full stop, ! or ? before white space, not an abbreviation's
SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bvs)(?<=[.!?])\s+")


def visible_units(html: str):
    """Each block of the page's main text (a paragraph, a list item's own text, a table row) as
    its text, the character spans of its https links, and whether it is a table row."""
    from bs4 import BeautifulSoup, NavigableString

    soup = BeautifulSoup(html, "html.parser")
    main = soup.find("article") or soup.find("main") or soup
    for hidden in main.find_all(["script", "style", "template"]):
        hidden.decompose()
    units: dict[int, tuple] = {}
    order = []
    for string in main.find_all(string=True):
        if not isinstance(string, NavigableString) or not str(string).strip():
            continue
        block = string.find_parent(lambda tag: tag.name in BLOCKS and (
            tag.name == "tr" or not tag.find_parent("tr")))
        if block is None:
            continue
        key = id(block)
        if key not in units:
            units[key] = ([], [], block.name == "tr")
            order.append(key)
        texts, links, _ = units[key]
        start = sum(len(t) for t in texts)
        texts.append(str(string))
        anchor = string.find_parent("a")
        if anchor is not None and str(anchor.get("href", "")).startswith("https://"):
            links.append((start, start + len(str(string))))
    for key in order:
        texts, links, is_row = units[key]
        yield "".join(texts), links, is_row


def unlinked_cited(html: str) -> list[str]:
    """Every sentence that says "cited" with no https link inside it. A table row is one
    statement (its figure, its level and its source side by side), so a row is one sentence."""
    missing = []
    for text, links, is_row in visible_units(html):
        if not re.search(r"\bcited\b", text, re.I):
            continue
        cursor = 0
        for sentence in [text] if is_row else SENTENCE_END.split(text):
            start = text.index(sentence, cursor)
            end = cursor = start + len(sentence)
            if re.search(r"\bcited\b", sentence, re.I) and not any(
                    a < end and b > start for a, b in links):
                missing.append(" ".join(sentence.split()))
    return missing


@pytest.fixture(scope="module")
def book_pages(reference_book):
    pages = [p for p in Path(reference_book).rglob("*.html")
             if not {"_static", "_sources", "_images"} & set(p.parts)
             and p.name not in ("genindex.html", "search.html")]
    assert len(pages) > 20
    return {p.relative_to(reference_book).as_posix(): p.read_text(encoding="utf-8")
            for p in pages}


def test_every_cited_sentence_of_the_built_book_links_its_source(book_pages):
    missing = {page: said for page, html in book_pages.items()
               if (said := unlinked_cited(html))}
    assert not missing, "\n".join(f"{page}: {s}" for page, said in missing.items() for s in said)


def test_no_page_names_a_file_the_repository_does_not_hold(book_pages):
    from bs4 import BeautifulSoup

    naming = {}
    for page, html in book_pages.items():
        text = BeautifulSoup(html, "html.parser").get_text(" ")
        # the study's notes (ANCHORS.md, "(ANCHORS 7)") and the build host's files live beside
        # the checkout, in ../shared: a reader of the book cannot open them
        found = re.findall(r"ANCHORS\.md|\(ANCHORS \d+\)|\.\./shared/[^\s)]*|TOOLCHAIN\.md", text)
        if found:
            naming[page] = sorted(set(found))
    assert not naming, naming


def test_the_built_book_links_threads_and_files_it_cites(book_pages):
    hrefs = {h for html in book_pages.values()
             for h in re.findall(r'href="(https://github\.com/[^"]+)"', html)}
    # the bounds page's cited figures (type 2 against type 5 on p5en) and the comparison page's
    # transport section (p6-b300, serving over GDAKI: lib.publish.sources.comparison_efa_section)
    for source_id in ("repro-results", "vllm-41183", "aws-sample-1230", "whn09-official",
                      "whn09-b300-b90a617", "aws-gdaki-benchmarks"):
        assert sources.url(source_id) in hrefs, source_id
    listed = {entry["url"] for entry in sources.sources().values()}
    unlisted = {h for h in hrefs if THREAD.match(urlparse(h).path) and h not in listed}
    assert not unlisted, f"threads the book links that sources.yaml does not list: {unlisted}"


def test_every_claim_of_the_coverage_page_links_its_source():
    from lib.publish import cited

    for claim in cited.CLAIMS:
        assert "](https://github.com/" in sources.link_references(claim["source"]), claim
