"""Every public source the book cites, and the links to them.

sources.yaml holds one entry per source (id, title, date, URL: a file at a commit, or a thread)
and the repository of each project whose threads the book names. `link_references` is applied
to every markdown page of the book as it is staged (lib.publish.book.stage_sources): it turns

- a known source name ("antonai-work/deepep-v2-efa-repro RESULTS.md", a reproduction's result
  file, "whn09/ep-benchmarks-efa", the id of a cited figure of lib/measure/cited_figures.yaml)
  into a link to the source at its commit, and
- a project's thread ("vLLM #54281", "awsome-distributed-ai PR #1230", "TensorRT-LLM's issues
  #17714/#17715", "kubernetes/kubernetes#96186", and a bare "#46408" after a project was named
  in the same paragraph or table row) into a link to the thread,

and leaves alone what is code (spans and fenced blocks, MyST roles and directives among them),
what is already a link, an image, a URL or an HTML tag. The visible text is unchanged: only a
link around it is added, so a table is no wider than before.

The figures the reader compares a transport against (GIN type 2 and type 5 on p5en, the
p6-b300 kernel figures, serving over GDAKI) are efa_transport_figures;
`comparison_efa_section` writes them as the comparison page's section.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

import pandas as pd
import yaml

from lib.measure import bounds, published

SOURCES_PATH = Path(__file__).with_name("sources.yaml")
# the cited figures of the bounds page: their ids name their sources in the book's tables
CITED_FIGURES_PATH = Path(__file__).resolve().parents[1] / "measure" / "cited_figures.yaml"

_BLOB = re.compile(r"^https://github\.com/(?P<repo>[^/]+/[^/]+)/blob/(?P<commit>[0-9a-f]{40})/"
                   r"(?P<path>.+)$")
_THREAD = re.compile(r"^https://github\.com/(?P<repo>[^/]+/[^/]+)/(?:issues|pull)/(?P<n>\d+)$")


# ---- the sources ------------------------------------------------------------------------------
@functools.cache
def _load() -> dict:
    data = yaml.safe_load(SOURCES_PATH.read_text(encoding="utf-8"))
    entries = {}
    for entry in data["sources"]:
        if entry["id"] in entries:
            raise ValueError(f"{SOURCES_PATH}: source id {entry['id']!r} twice")
        entries[entry["id"]] = entry
    return {"sources": entries, "projects": data.get("projects") or {}}


def sources() -> dict[str, dict]:
    """Every source by id: id, title, date, url, and the names the book writes for it."""
    return dict(_load()["sources"])


def source(source_id: str) -> dict:
    try:
        return _load()["sources"][source_id]
    except KeyError:
        raise KeyError(f"no source {source_id!r} in {SOURCES_PATH}") from None


def url(source_id: str) -> str:
    """The source's URL: a repository file at a commit, or a thread."""
    return source(source_id)["url"]


def md_link(text: str, source_id: str) -> str:
    """`text` as a markdown link to the source."""
    return f"[{_escape_link_text(text)}]({url(source_id)})"


def cited(source_id: str) -> str:
    """How a sentence names a cited source: its title, linked, and its date."""
    entry = source(source_id)
    return f"{md_link(entry['title'], source_id)}, {entry['date']}"


def _escape_link_text(text: str) -> str:
    return text.replace("[", r"\[").replace("]", r"\]")


def thread_url(repo: str, number: int | str) -> str:
    """A project's thread: the source's URL where sources.yaml lists it (so /pull/ for a pull
    request), else /issues/N, which GitHub redirects to the pull request of that number."""
    listed = _threads().get((repo.lower(), int(number)))
    return listed["url"] if listed else f"https://github.com/{repo}/issues/{int(number)}"


@functools.cache
def _threads() -> dict[tuple[str, int], dict]:
    found = {}
    for entry in _load()["sources"].values():
        m = _THREAD.match(entry["url"])
        if m:
            found[(m["repo"].lower(), int(m["n"]))] = entry
    return found


@functools.cache
def _names() -> dict[str, str]:
    """Every phrase the linker turns into a link, with its URL."""
    names: dict[str, str] = {}

    def add(name: str, target: str) -> None:
        if names.get(name, target) != target:
            raise ValueError(f"{name!r} names two sources: {names[name]} and {target}")
        names[name] = target

    for entry in _load()["sources"].values():
        blob = _BLOB.match(entry["url"])
        if blob:  # a file is named by its repository and its path
            add(f"{blob['repo']} {blob['path']}", entry["url"])
            add(f"{blob['repo']}, {blob['path']}", entry["url"])
        for name in entry.get("names") or []:
            add(name, entry["url"])
    for figure_id, source_id in cited_figure_sources().items():
        add(figure_id, url(source_id))
    return names


def cited_figure_sources(path: Path = CITED_FIGURES_PATH) -> dict[str, str]:
    """The source id of each cited figure of the bounds page (cited_figures.yaml `source_id`):
    a table row naming the figure links to where it was published."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    return {entry["id"]: entry["source_id"] for entry in data.get("cited") or []
            if entry.get("source_id")}


# ---- the linker ------------------------------------------------------------------------------
# What is never touched: a link or image (its text included), a code span, an autolink, a
# bare URL, an HTML tag or comment. Leftmost first; at one position the first alternative wins.
_PROTECTED = re.compile(
    r"!?\[(?:[^\[\]\n]|\[[^\]\n]*\])*\]\([^)\n]*\)"   # [text](url), ![alt](src)
    # `code`, ``code``, {role}`target`: within one paragraph or table row, as CommonMark reads
    # it (an unmatched backtick, as in a quoted log line, is a literal one)
    r"|(?P<ticks>`+)(?:(?!\n[ \t]*(?:\n|\|))[\s\S])+?(?<!`)(?P=ticks)(?!`)"
    r"|<!--[\s\S]*?-->"                                # an HTML comment
    r"|<(?:https?://|mailto:)[^>\s]+>"                 # an autolink
    r"|</?[A-Za-z][A-Za-z0-9-]*(?:\s[^<>]*)?/?>"       # an HTML tag
    r"|https?://[^\s)>\]|]+")                          # a bare URL
_FENCE = re.compile(r"^\s{0,12}(?P<fence>`{3,}|~{3,})")
_LIST_ITEM = re.compile(r"^ *(?:[-*+]|\d{1,9}[.)]) +")
# a name's edges: not inside a longer word, path or version ("trtllm-0.21.0/torch" is not the
# pin set "trtllm-0.21.0"; "RESULTS.md." at a sentence's end is "RESULTS.md")
_BEFORE = r"(?<![\w/.\-@])"
_AFTER = r"(?![\w/\-@]|\.\w)"
_KIND = r"(?:PRs?|pull requests?|issues?)"
# "#N", then more numbers of the same project: "#A, #B", "#A/#B", "#A and PR #B", "#A, and #B"
_NUMBER_SEPARATOR = r"(?:\s*,\s*(?:(?:and|or)\s+)?|\s*/\s*|\s+(?:and|or)\s+)"
_NUMBER_LIST = rf"#(?P<first>\d+)(?P<more>(?:{_NUMBER_SEPARATOR}(?:{_KIND}\s+)?#\d+)*)"


@functools.cache
def _scanner() -> re.Pattern:
    # a name's spaces match any white space: prose wraps a name across lines
    names = [re.escape(n).replace(r"\ ", r"\s+") for n in sorted(_names(), key=len, reverse=True)]
    projects = sorted({alias for repo, aliases in _load()["projects"].items()
                       for alias in [repo, *(aliases or [])]}, key=len, reverse=True)
    return re.compile(
        rf"(?P<sep>\n[ \t]*\n|\n(?=[ \t]*\|))"
        rf"|{_BEFORE}(?P<name>{'|'.join(names)}){_AFTER}"
        rf"|{_BEFORE}(?P<owner_repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)#(?P<or_n>\d+)\b"
        rf"|{_BEFORE}(?P<project>{'|'.join(map(re.escape, projects))})(?![\w/\-])"
        rf"(?:'s)?(?P<ref>\s+(?:{_KIND}\s+)?{_NUMBER_LIST})?"
        rf"|(?<![\w&#/])(?P<bare>(?:{_KIND}\s+)?#(?P<bare_n>\d{{2,}}))\b")


@functools.cache
def _repo_of() -> dict[str, str]:
    """A project's name as prose writes it -> its repository."""
    found = {}
    for repo, aliases in _load()["projects"].items():
        for alias in [repo, *(aliases or [])]:
            found[alias] = repo
    return found


def link_references(markdown: str) -> str:
    """The page with every known source name and every project-qualified thread reference
    made a link (see the module's docstring); code, links and markup left as they are."""
    out: list[str] = []
    named: list[str] = []  # the projects named so far in this paragraph or table row, in order
    for protected, text in _segments(markdown):
        if protected:
            if "\n\n" in text or text.lstrip().startswith(("```", "~~~")):
                named.clear()  # a code block ends the paragraph
            out.append(text)
        else:
            out.append(_link_free_text(text, named))
    return "".join(out)


_MADE_LINK = re.compile(r"\[((?:[^\[\]]|\\[\[\]])+)\]\((https://[^)\s]+)\)")


def strip_links(markdown: str) -> str:
    """The page as it read before link_references: each link to an https address back to its
    text (for comparing a staged page with the text that made it)."""
    return _MADE_LINK.sub(lambda m: m[1], markdown)


def _link_free_text(text: str, named: list[str]) -> str:
    def replace(m: re.Match) -> str:
        if m["sep"] is not None:
            named.clear()
            return m[0]
        if m["name"] is not None:
            return f"[{m['name']}]({_names()[' '.join(m['name'].split())]})"
        if m["owner_repo"] is not None:
            repo = m["owner_repo"]
            named.append(repo)
            return f"[{m[0]}]({thread_url(repo, m['or_n'])})"
        if m["project"] is not None:
            repo = _repo_of()[m["project"]]
            named.append(repo)
            if m["ref"] is None:
                return m[0]
            return _link_number_list(m[0], repo)
        repo = _bare_number_project(int(m["bare_n"]), named)
        if repo is None:  # a bare "#N" with no project named before it: left as it is
            return m[0]
        return f"[{m['bare']}]({thread_url(repo, m['bare_n'])})"

    return _scanner().sub(replace, text)


def _bare_number_project(number: int, named: list[str]) -> str | None:
    """The project a bare "#N" belongs to: of the projects named before it in its paragraph, the
    latest whose thread N sources.yaml lists ("DeepEP b306af06, aws-ofi-nccl 9c44d34, the PR #612
    trio": DeepEP's), else the latest named. A number is never given to a project the paragraph
    does not name."""
    if not named:
        return None
    for repo in reversed(named):
        if (repo.lower(), number) in _threads():
            return repo
    return named[-1]


def _link_number_list(said: str, repo: str) -> str:
    """'vLLM #41183' -> one link; "TensorRT-LLM's issues #17714/#17715" -> the name and the first
    number one link, each further number its own."""
    numbers = list(re.finditer(r"#(\d+)", said))
    head_end = numbers[0].end()
    out = [f"[{said[:head_end]}]({thread_url(repo, numbers[0][1])})"]
    cursor = head_end
    for m in numbers[1:]:
        out.append(said[cursor:m.start()])
        out.append(f"[{m[0]}]({thread_url(repo, m[1])})")
        cursor = m.end()
    out.append(said[cursor:])
    return "".join(out)


def _segments(markdown: str) -> list[tuple[bool, str]]:
    """The page cut into (protected, text) pieces: code blocks whole (fenced, and indented: four
    spaces past the list item the block sits in, after a blank line), then within the rest
    every link, code span, URL and tag; everything else is free text the linker may touch."""
    pieces: list[tuple[bool, str]] = []
    free: list[str] = []
    block: list[str] = []
    fence: str | None = None      # the open fence's backticks or tildes
    indented: int | None = None   # the open indented block's indentation
    list_indent, after_blank = 0, True

    def open_block(line: str) -> None:
        nonlocal free, block
        pieces.extend(_inline_segments("".join(free)))
        free, block = [], [line]

    for line in markdown.splitlines(keepends=True):
        text = line.expandtabs(4)
        blank = not text.strip()
        indent = len(text) - len(text.lstrip(" "))
        if fence is not None:
            block.append(line)
            stripped = line.strip()
            if stripped.startswith(fence[0] * len(fence)) and not stripped.strip(fence[0]):
                pieces.append((True, "".join(block)))
                fence, block = None, []
            continue
        if indented is not None:
            if not blank and indent >= indented:
                block.append(line)
                continue
            pieces.append((True, "".join(block)))
            indented, block = None, []
        m = _FENCE.match(line)
        if m:
            fence = m["fence"]
            open_block(line)
        elif after_blank and not blank and indent >= list_indent + 4:
            indented = list_indent + 4
            open_block(line)
        else:
            item = _LIST_ITEM.match(text)
            if item:
                list_indent = len(item[0])
            elif after_blank and not blank and indent < list_indent:
                list_indent = indent  # a paragraph outside the list: the list has ended
            free.append(line)
        after_blank = blank
    if block:  # an unclosed fence runs to the end, as CommonMark reads it
        pieces.append((True, "".join(block)))
    pieces.extend(_inline_segments("".join(free)))
    return [p for p in pieces if p[1]]


def _inline_segments(text: str) -> list[tuple[bool, str]]:
    pieces, cursor = [], 0
    for m in _PROTECTED.finditer(text):
        pieces.append((False, text[cursor:m.start()]))
        pieces.append((True, m[0]))
        cursor = m.end()
    pieces.append((False, text[cursor:]))
    return pieces


# ---- the comparison page's section of transport figures ---------------------------------------
def efa_transport_figures() -> pd.DataFrame:
    """The public DeepEP V2 figures (their data: lib.measure.published and
    lib/measure/cited_figures.yaml) over EFA a transport is compared against, one row per figure:
    group, figure, gin_type, nodes, tokens (kernel rows), phase, concurrency (serving rows),
    value, unit, decimals, hardware, setup, date, source_id (lib/publish/sources.yaml), level
    (always "cited": none is measured here)."""
    rows = []
    for entry in bounds.load_cited()["cited"]:
        if entry.get("source_id") != published.P5EN_GIN_SOURCE_ID:
            continue
        gin_type = entry["gin_type"]
        for phase, value in entry["phases"].items():
            rows.append({
                "group": published.P5EN_GIN_GROUP, "gin_type": gin_type, "nodes": entry["nodes"],
                "tokens": entry["tokens"], "phase": phase, "value": float(value),
                "figure": f"{entry['nodes']} nodes, {entry['tokens']} tokens, {phase}, "
                          f"type {gin_type}",
                "hardware": f"{entry['instance']} ({entry['ranks_per_node']} ranks a node) "
                            "over EFA, 2 and 4 nodes",
                "setup": "amazon-contributing/DeepEP ec623f3, EFA installer 1.50.0, NCCL 2.31.2, "
                         "test_ep, 12 SMs, hidden 7168, top-8 of 256 experts, FP8 dispatch",
                "date": entry["date"], "source_id": entry["source_id"]})
    for tokens, phase, value in published.P6_B300["figures"]:
        rows.append({**{k: published.P6_B300[k] for k in ("group", "hardware", "setup", "date",
                                                "source_id", "gin_type", "nodes")},
                     "tokens": tokens, "phase": phase, "value": value,
                     "figure": f"{tokens} tokens, {phase}"})
    serving = {k: published.GDAKI_SERVING[k] for k in ("group", "hardware", "setup", "date", "source_id",
                                             "nodes")}
    for concurrency, by_type in published.GDAKI_SERVING["eager"].items():
        for gin_type, value in zip((3, 2), by_type):
            rows.append({**serving, "gin_type": gin_type, "concurrency": concurrency,
                         "phase": "eager", "value": value,
                         "figure": f"c{concurrency} output tok/s, eager, type {gin_type}"})
    rows.append({**serving, "gin_type": 3, "concurrency": 64, "phase": "CUDA graphs",
                 "value": published.GDAKI_SERVING["graphs_c64_gdaki"],
                 "figure": "c64 output tok/s, CUDA graphs, type 3"})
    table = pd.DataFrame(rows, columns=list(published.EFA_TRANSPORT_COLUMNS))
    table["unit"] = ["tok/s" if pd.notna(c) else "us" for c in table["concurrency"]]
    table["decimals"] = 1
    table["level"] = "cited"
    return table


def comparison_efa_section() -> str:
    """The comparison page's section: the public DeepEP V2 figures over EFA that a reader sets a
    transport against (GIN type 2 against type 5 on 2 and 4 p5en nodes, the p6-b300 kernel
    figures, vLLM serving over GDAKI against the CPU proxy), each group with its level, date
    and linked source; from efa_transport_figures, none measured here.
    Every ratio is computed from the two published figures beside it."""
    table = efa_transport_figures()
    lines = ["(efa-transports)=", "## DeepEP V2 over EFA, by transport: the published figures\n",
             "What others measured with DeepEP V2 over EFA, by NCCL's GIN type: type 2 is the CPU "
             "proxy (the type NCCL picks by default with the EFA installer 1.50.0), type 5 the "
             "GPU-initiated path (`NCCL_GIN_TYPE=5` with `NCCL_SYM_GIN_KERNELS_ENABLE=0`), type 3 "
             "GDAKI as the AWS serving sample configures it. None of it is measured here: each "
             "group names its source, linked at the version read, and the date it gives. The "
             "guide's own kernel figures are of one host over NVLink (above), so no ratio to them "
             "is given.\n"]
    for group, rows in table.groupby("group", sort=False):
        first = rows.iloc[0]
        linked = md_link(source(first["source_id"])["title"], first["source_id"])
        lines.append(f"**{group}**: {first['hardware']}; {first['setup']}. Level: cited, "
                     f"{first['date']}, from {linked}.\n")
        if rows["concurrency"].notna().any():
            lines += _serving_rows(rows)
        elif rows["gin_type"].nunique() > 1:
            lines.append(_md_table(_by_gin_type(rows)) + "\n")
        else:
            lines.append(_md_table(pd.DataFrame({
                "tokens": rows["tokens"].astype(int), "phase": rows["phase"],
                f"type {int(first['gin_type'])} (us)": [_said(v) for v in rows["value"]]})) + "\n")
    return "\n".join(lines) + "\n"


def _by_gin_type(rows: pd.DataFrame) -> pd.DataFrame:
    """Type 2 beside type 5 per nodes, tokens and phase, with type 2 / type 5 (above 1: type 5
    took less time)."""
    wide = rows.pivot_table(index=["nodes", "tokens", "phase"], columns="gin_type",
                            values="value", sort=False).reset_index()
    return pd.DataFrame({
        "nodes": wide["nodes"].astype(int), "tokens": wide["tokens"].astype(int),
        "phase": wide["phase"],
        "type 2 (us)": [_said(v) for v in wide[2]], "type 5 (us)": [_said(v) for v in wide[5]],
        "type 2 / type 5": [f"{a / b:.2f}" for a, b in zip(wide[2], wide[5])]})


def _serving_rows(rows: pd.DataFrame) -> list[str]:
    eager = rows[rows["phase"] == "eager"].pivot_table(index="concurrency", columns="gin_type",
                                                       values="value").reset_index()
    out = [_md_table(pd.DataFrame({
        "concurrency": eager["concurrency"].astype(int),
        "GDAKI, type 3 (tok/s)": [_said(v) for v in eager[3]],
        "CPU proxy, type 2 (tok/s)": [_said(v) for v in eager[2]],
        "GDAKI / proxy": [f"{a / b:.3f}" for a, b in zip(eager[3], eager[2])]})) + "\n"]
    graphs = rows[rows["phase"] == "CUDA graphs"]
    for row in graphs.itertuples():
        eager_same = eager.loc[eager["concurrency"] == row.concurrency, 3]
        if len(eager_same):
            out.append(f"With CUDA graphs (not `--enforce-eager`) on GDAKI, concurrency "
                       f"{int(row.concurrency)} gave {_said(row.value)} tok/s, "
                       f"{row.value / float(eager_same.iloc[0]):.2f}x its eager figure.\n")
    return out


def _said(value: float) -> str:
    return f"{value:.1f}"


def _md_table(df) -> str:
    from lib.publish import report

    return report._md_table(df)
