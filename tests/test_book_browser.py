"""The published book in a real browser: Debian's headless Chromium on a real HTTP server.

Each check's FAIL path first, on small pages written here and served for real; then the book,
built from the reference run: every one of its pages, loaded in turn in a 1400 x 900 window and
on an emulated 390 x 844 phone (one browser for each), with every dropdown opened, checked for:
a page no wider than the window, no table wider than its column (and, in the window, every
table of the book's own laid out as a table, not as cards), no broken image, no console error
but the browser's favicon probe, every link out of the book well formed, a main content that is
not empty. A failing page's screenshot is kept under _build/test-artifacts/browser/<size>/; a
passing one is not shot. Then every internal link of the html tree, statically.

Without /usr/bin/chromium (scripts/chromium.sh install) the browser tests skip with the reason,
unless REPRO_BROWSER_REQUIRED=1 (the Makefile's `unit`), where they fail.
"""
import importlib.util
import os
import re
import time

import pytest

from lib.core.door import REPO_ROOT
from tests import browser

REFERENCE = (REPO_ROOT / "results" / "REFERENCE").read_text().strip()
ARTIFACTS = REPO_ROOT / "_build" / "test-artifacts" / "browser"
# Pages a reader must find among the book's pages (every page is checked; these must be there).
PAGES = {
    "landing": "book/intro.html",
    "results": "book/results.html",
    "stage": "book/stages/04_serve.html",
    "appendix": "book/history.html",
    "run": f"book/runs/{REFERENCE}.html",
}
SIZES = {"window": browser.WINDOW, "phone": browser.PHONE}
# pydata-sphinx-theme's main column; python's http.server titles its 404 "Error response".
# (the search page has no article: its content is the search form's container)
MAIN_CONTENT = "main#main-content article, main#main-content .bd-search-container"
ERROR_TITLE = re.compile(r"^\s*$|\b404\b|error response|not found", re.IGNORECASE)


def not_a_book_page(driver) -> list[str]:
    """The page loaded: a title that is not an error page's, and a main content with text."""
    problems = []
    if ERROR_TITLE.search(driver.title):
        problems.append(f"title {driver.title!r}: empty or an error page's")
    # the main content's rendered text, read by the page itself: Selenium's element.text walks
    # a long page node by node (13 of 45 s for the book's 63 pages)
    text = driver.execute_script(
        "const main = document.querySelector(arguments[0]);"
        "return main === null ? null : main.innerText.trim().length;", MAIN_CONTENT)
    if text is None:
        problems.append(f"no main content ({MAIN_CONTENT})")
    elif not text:
        problems.append(f"main content ({MAIN_CONTENT}) is empty")
    return problems


def results_page_problems(driver) -> list[str]:
    """The results page shows its numbers: at least one <table> and one <img>."""
    from selenium.webdriver.common.by import By

    return [f"no <{tag}>" for tag in ("table", "img")
            if not driver.find_elements(By.TAG_NAME, tag)]


# ---- the skip-or-fail rule, without a browser -------------------------------------------------

def test_a_missing_browser_skips_unless_required(tmp_path):
    present = tmp_path / "chromedriver"
    present.write_text("")
    absent = tmp_path / "chromium"
    assert browser.missing_browser({}, chromium=present, chromedriver=present) is None
    verdict, why = browser.missing_browser({}, chromium=absent, chromedriver=present)
    assert verdict == "skip" and str(absent) in why and "scripts/chromium.sh install" in why
    assert browser.missing_browser({"REPRO_BROWSER_REQUIRED": "0"}, chromium=absent,
                                   chromedriver=present)[0] == "skip"
    with pytest.raises(pytest.skip.Exception, match="chromium missing"):
        browser.require_browser({}, chromium=absent, chromedriver=present)
    browser.require_browser({}, chromium=present, chromedriver=present)  # returns: nothing raised


def test_a_missing_browser_fails_when_required(tmp_path):
    present = tmp_path / "chromium"
    present.write_text("")
    absent = tmp_path / "chromedriver"
    required = {"REPRO_BROWSER_REQUIRED": "1"}
    verdict, why = browser.missing_browser(required, chromium=present, chromedriver=absent)
    assert verdict == "fail" and str(absent) in why and "REPRO_BROWSER_REQUIRED=1" in why
    with pytest.raises(pytest.fail.Exception, match="chromedriver missing"):
        browser.require_browser(required, chromium=present, chromedriver=absent)
    browser.require_browser(required, chromium=present, chromedriver=present)


# ---- each check's FAIL and PASS paths, on pages served for real --------------------------------

@pytest.fixture(scope="module")
def driver():
    browser.require_browser(os.environ)
    with browser.chromium() as started:
        yield started


def write_pages(root, pages: dict[str, str]):
    for name, html in pages.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(html, encoding="utf-8")
    return root


def png(path):
    from PIL import Image

    Image.new("RGB", (4, 3), "red").save(path)


def test_broken_images_names_a_missing_and_an_undecodable_image(driver, tmp_path):
    png(tmp_path / "good.png")
    (tmp_path / "garbage.png").write_bytes(b"not a png at all")
    write_pages(tmp_path, {
        "clean.html": '<title>t</title><img src="good.png">',
        "broken.html": '<title>t</title><img src="good.png"><img src="missing.png">'
                       '<img src="garbage.png">'})
    with browser.serve(tmp_path) as base:
        browser.load(driver, base + "clean.html")
        assert browser.broken_images(driver) == []
        browser.load(driver, base + "broken.html")
        assert browser.broken_images(driver) == [
            "missing.png (complete=True, naturalWidth=0)",
            "garbage.png (complete=True, naturalWidth=0)"]


def test_console_errors_reports_a_throwing_script_and_passes_a_quiet_page(driver, tmp_path):
    write_pages(tmp_path, {
        "quiet.html": "<title>t</title><script>console.log('fine'); console.warn('meh')</script>",
        "throws.html": "<title>t</title><script>throw new Error('planted failure')</script>"})
    with browser.serve(tmp_path) as base:
        browser.load(driver, base + "quiet.html")
        assert browser.console_errors(driver) == []
        browser.load(driver, base + "throws.html")
        errors = browser.console_errors(driver)
    assert len(errors) == 1 and "Uncaught Error: planted failure" in errors[0]


def log_until(driver, text: str, timeout_s: float = 5) -> list[dict]:
    """The browser log's entries, read until one names `text` (requests made after the load
    event, such as icons, are logged a little later)."""
    entries = []
    deadline = time.monotonic() + timeout_s
    while not any(text in e["message"] for e in entries) and time.monotonic() < deadline:
        time.sleep(0.05)
        entries += driver.get_log("browser")
    return entries


def test_only_the_browsers_own_favicon_probe_is_left_out(driver, tmp_path):
    """The probe is real (Chromium logs its 404 just after the load) and is left out; an icon
    the page names itself, missing, is reported."""
    write_pages(tmp_path, {"plain.html": "<title>t</title><p>no icon named</p>",
                           "icon.html": '<title>t</title><link rel="icon" href="gone.png">'})
    not_found = ("Failed to load resource: the server responded with a status of 404 "
                 "(File not found)")
    with browser.serve(tmp_path) as base:
        browser.load(driver, base + "plain.html")
        entries = log_until(driver, "/favicon.ico")
        assert [e["message"] for e in entries] == [f"{base}favicon.ico - {not_found}"]
        assert browser.severe_messages(entries, driver.current_url) == []
        browser.load(driver, base + "icon.html")
        entries = log_until(driver, "gone.png")
        assert browser.severe_messages(entries, driver.current_url) == [
            f"{base}gone.png - {not_found}"]


def test_the_page_check_knows_a_404_and_an_empty_page_from_a_page(driver, tmp_path):
    write_pages(tmp_path, {
        "page.html": '<title>A page</title><main id="main-content"><article>words</article></main>',
        "hollow.html": '<title>Hollow</title><main id="main-content"><article> </article></main>',
        "bare.html": "<title>Bare</title><p>no theme</p>"})
    with browser.serve(tmp_path) as base:
        browser.load(driver, base + "page.html")
        assert not_a_book_page(driver) == []
        browser.load(driver, base + "hollow.html")
        assert not_a_book_page(driver) == [f"main content ({MAIN_CONTENT}) is empty"]
        browser.load(driver, base + "bare.html")
        assert not_a_book_page(driver) == [f"no main content ({MAIN_CONTENT})"]
        browser.load(driver, base + "absent.html")
        assert not_a_book_page(driver) == ["title 'Error response': empty or an error page's",
                                           f"no main content ({MAIN_CONTENT})"]


def test_the_results_check_wants_a_table_and_an_image(driver, tmp_path):
    png(tmp_path / "plot.png")
    table = "<table><tr><td>1</td></tr></table>"
    write_pages(tmp_path, {"neither.html": "<title>t</title><p>prose only</p>",
                           "table.html": f"<title>t</title>{table}",
                           "both.html": f'<title>t</title>{table}<img src="plot.png">'})
    with browser.serve(tmp_path) as base:
        browser.load(driver, base + "neither.html")
        assert results_page_problems(driver) == ["no <table>", "no <img>"]
        browser.load(driver, base + "table.html")
        assert results_page_problems(driver) == ["no <img>"]
        browser.load(driver, base + "both.html")
        assert results_page_problems(driver) == []


# A table in a column as the theme builds one: a 600 px column (the theme's article, class
# bd-article), the theme's scroll container around each table, and Sphinx's inline code
# (<code><span class="pre">), kept unbroken.
COLUMN = ('<title>t</title><style>article {width: 600px} '
          '.pst-scrollable-table-container {overflow-x: auto} '
          'span.pre {white-space: nowrap}</style>')
# four columns of run ids: each unbroken, the row is wider than the column
RUN_IDS = "".join('<td><code class="literal"><span class="pre">gpu-2xh200-deepep-vllm-2026113'
                  f'{i}</span></code></td>' for i in range(4))


def in_column(table: str, stylesheet: str = "") -> str:
    return (COLUMN + stylesheet + '<article class="bd-article">'
            '<div class="pst-scrollable-table-container">' + table + "</div></article>")


def test_wide_tables_names_a_table_wider_than_its_column_or_the_window(driver, tmp_path):
    long_word = "x" * 200
    write_pages(tmp_path, {
        "fits.html": in_column("<table><tr><th>run</th><th>level</th></tr><tr><td>a-run</td>"
                               "<td>measured, wrapping as words do</td></tr></table>"),
        "word.html": in_column(f"<table><tr><th>why</th></tr><tr><td>{long_word}</td></tr>"
                               "</table>"),
        "window.html": '<title>t</title><table style="width: 2000px"><tr><td>x</td></tr>'
                       "</table>"})
    with browser.serve(tmp_path) as base:
        assert driver.execute_script("return window.innerWidth") == browser.WINDOW[0]
        browser.load(driver, base + "fits.html")
        assert browser.wide_tables(driver) == []
        (fits,) = browser.table_widths(driver)
        assert fits["name"] == "run level" and fits["width"] <= fits["room"] == 600
        browser.load(driver, base + "word.html")
        (problem,) = browser.wide_tables(driver)
        assert re.fullmatch(r"table 1 \(why\): \d+ px in 600 px", problem), problem
        browser.load(driver, base + "window.html")
        (problem,) = browser.wide_tables(driver)
        room = re.fullmatch(r"table 1 \(x\): 2000 px in (\d+) px", problem)
        assert room and int(room.group(1)) < browser.WINDOW[0], problem


def test_the_books_stylesheet_lets_run_ids_wrap_in_a_table(driver, tmp_path):
    """book/_static/tables.css is what makes the pages' tables fit: the same table of run ids,
    in the same column, is too wide without it."""
    css = (REPO_ROOT / "book" / "_static" / "tables.css").read_text(encoding="utf-8")
    table = f"<table><tr>{RUN_IDS}</tr></table>"
    write_pages(tmp_path, {"bare.html": in_column(table),
                           "styled.html": in_column(table, f"<style>{css}</style>")})
    with browser.serve(tmp_path) as base:
        browser.load(driver, base + "bare.html")
        assert len(browser.wide_tables(driver)) == 1
        browser.load(driver, base + "styled.html")
        assert browser.wide_tables(driver) == []


def book_stylesheet() -> str:
    return (REPO_ROOT / "book" / "_static" / "tables.css").read_text(encoding="utf-8")


def fit_script() -> str:
    """The script book/_ext/table_fit.py adds to every page (read from the extension itself)."""
    spec = importlib.util.spec_from_file_location(
        "table_fit", REPO_ROOT / "book" / "_ext" / "table_fit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FIT_SCRIPT


# A page as the theme lays one out on a phone: its meta viewport, the article's class, and a
# run id in the title as Sphinx writes inline code (the theme keeps .pre on one line).
PHONE_PAGE = ('<meta name="viewport" content="width=device-width, initial-scale=1">'
              "<title>t</title><style>span.pre {white-space: nowrap}</style>{css}"
              '<main id="main-content"><article class="bd-article"><h1>Run <code class="literal">'
              '<span class="pre">gpu-2xh200-deepep-vllm-20261130d-and-a-longer-name</span>'
              "</code></h1><p>words that wrap as words do</p></article></main>")


def test_page_width_names_a_page_wider_than_a_phone_and_the_stylesheet_fixes_it(phone, tmp_path):
    write_pages(tmp_path, {
        "fits.html": PHONE_PAGE.replace("{css}", "").replace(
            "gpu-2xh200-deepep-vllm-20261130d-and-a-longer-name", "a-run"),
        "wide.html": PHONE_PAGE.replace("{css}", ""),
        "styled.html": PHONE_PAGE.replace("{css}", f"<style>{book_stylesheet()}</style>")})
    with browser.serve(tmp_path) as base:
        browser.load(phone, base + "fits.html")
        assert phone.execute_script("return document.documentElement.clientWidth") == 390
        assert browser.page_width_problems(phone) == []
        browser.load(phone, base + "wide.html")
        (problem,) = browser.page_width_problems(phone)
        sticking_out = r"\(span\.pre 'gpu-2xh200-deepep-vllm-"
        assert re.match(r"page: \d+ px wide in 390 px " + sticking_out, problem), problem
        # the same page with the book's stylesheet: the inline code wraps, the page fits
        browser.load(phone, base + "styled.html")
        assert browser.page_width_problems(phone) == []


def test_a_link_out_of_the_book_must_be_https_with_a_host_and_a_path(driver, tmp_path):
    links = ['<a href="https://docs.nvidia.com/cuda/index.html">ok</a>',
             '<a href="http://127.0.0.1:8000/v1/models">the reader\'s own server</a>',
             '<a href="other.html#part">in the book</a>', '<a href="#top">top</a>',
             '<a href="http://github.com/deepseek-ai/DeepEP">plain http</a>',
             '<a href="https:///deepseek-ai/DeepEP">no host</a>',
             '<a href="https://github.com">no path</a>']
    write_pages(tmp_path, {"good.html": "<title>t</title>" + "".join(links[:4]),
                           "bad.html": "<title>t</title>" + "".join(links)})
    with browser.serve(tmp_path) as base:
        browser.load(driver, base + "good.html")
        assert browser.external_link_problems(driver) == []
        browser.load(driver, base + "bad.html")
        assert browser.external_link_problems(driver) == [
            "http://github.com/deepseek-ai/DeepEP (not https)",
            "https:///deepseek-ai/DeepEP (no host)", "https://github.com (no path)"]


def test_the_fitting_script_lays_a_table_too_wide_for_its_column_out_as_cards(phone, tmp_path):
    """book/_ext/table_fit.py's script, with the book's stylesheet: a table of six columns of
    unbreakable words is too wide for a phone; the script shows it as one card per row, each
    value under its column's name, and then it fits, in a dropdown too once opened; a table
    that fits is left a table."""
    head = "".join(f"<th>column {i}</th>" for i in range(6))
    row = "".join(f"<td>value_{i}_without_a_place_to_break</td>" for i in range(6))
    wide = f"<table><thead><tr>{head}</tr></thead><tbody><tr>{row}</tr></tbody></table>"
    narrow = "<table><thead><tr><th>a</th></tr></thead><tbody><tr><td>1</td></tr></tbody></table>"
    page = ('<meta name="viewport" content="width=device-width, initial-scale=1">'
            '<title>t</title>{css}<main id="main-content"><article class="bd-article">'
            f'<div class="holder">{wide}</div><details><summary>more</summary>'
            f'<div class="holder">{wide}</div></details>{narrow}</article></main>')
    style = f"<style>{book_stylesheet()}</style>"
    write_pages(tmp_path, {"bare.html": page.replace("{css}", style),
                           "fitted.html": page.replace("{css}", style
                                                       + f"<script>{fit_script()}</script>")})
    with browser.serve(tmp_path) as base:
        browser.load(phone, base + "bare.html")
        # Chromium lays out a closed <details>' content too: both wide tables are measured
        assert len(browser.wide_tables(phone)) == 2
        browser.load(phone, base + "fitted.html")
        assert browser.wide_tables(phone) == []
        assert browser.stacked_tables(phone)[0] == {"name": head_text(6), "recorded": False}
        assert phone.execute_script(
            "return document.querySelector('td').getAttribute('data-label')") == "column 0"
        assert browser.open_details(phone) == 1
        assert browser.wide_tables(phone) == []
        assert browser.stacked_tables(phone) == [{"name": head_text(6), "recorded": False}] * 2


def test_the_fitting_script_lets_a_long_word_break_before_it_resorts_to_cards(driver, tmp_path):
    """A digest in a two-column table is wider than a 600 px column with its words whole: the
    script lets that table's words break (`table-wrap-anywhere`) and it fits, still a table."""
    digest = "sha256:" + "2b7da5c8d054b4d9" * 8
    table = (f"<table><thead><tr><th>gate</th><th>observed</th></tr></thead><tbody><tr>"
             f"<td>patch</td><td>{digest}</td></tr></tbody></table>")
    style = f"<style>{book_stylesheet()}</style>"
    write_pages(tmp_path, {"bare.html": in_column(table, style),
                           "fitted.html": in_column(table, style
                                                    + f"<script>{fit_script()}</script>")})
    with browser.serve(tmp_path) as base:
        browser.load(driver, base + "bare.html")
        (problem,) = browser.wide_tables(driver)
        assert problem.startswith("table 1 (gate observed): ") and problem.endswith("in 600 px")
        browser.load(driver, base + "fitted.html")
        assert browser.wide_tables(driver) == [] and browser.stacked_tables(driver) == []
        assert driver.execute_script(
            "return document.querySelector('table').className") == "table-wrap-anywhere"


def test_a_notebooks_recorded_frame_laid_out_as_cards_is_told_from_the_books_tables(
        phone, tmp_path):
    """In the window every table of the book's own must fit as a table; a frame a run's notebook
    recorded (pandas' HTML in a cell's output) may be shown as cards: stacked_tables says which."""
    head = "".join(f"<th>column {i}</th>" for i in range(8))
    row = "".join(f"<td>value_{i}_without_a_place_to_break</td>" for i in range(8))
    frame = f"<table><thead><tr>{head}</tr></thead><tbody><tr>{row}</tr></tbody></table>"
    write_pages(tmp_path, {"page.html": (
        '<meta name="viewport" content="width=device-width, initial-scale=1"><title>t</title>'
        f"<style>{book_stylesheet()}</style><script>{fit_script()}</script>"
        '<article class="bd-article"><div class="cell_output"><div>' + frame + "</div></div>"
        "<div>" + frame + "</div></article>")})
    with browser.serve(tmp_path) as base:
        browser.load(phone, base + "page.html")
        assert browser.stacked_tables(phone) == [{"name": head_text(8), "recorded": True},
                                                 {"name": head_text(8), "recorded": False}]


def head_text(columns: int) -> str:
    """A table's name as the checks give it: its first row's text, its first 50 characters."""
    return " ".join(f"column {i}" for i in range(columns))[:50]


CLEAN_TREE = {
    "index.html": '<meta http-equiv="Refresh" content="0; url=book/a.html" />',
    "book/a.html": '<h1 id="top-title">A</h1><a href="#top-title">self</a>'
                   '<a href="b.html#part">b</a><a href="../sub/">sub</a><a href="#">top</a>'
                   '<a href="../_static/style.css?digest=1">css</a>'
                   '<a href="https://example.org/x">out</a><a href="mailto:a@b.c">mail</a>'
                   '<script src="//cdn.example.org/lib.js"></script>'
                   '<img src="data:image/png;base64,AAAA"><a href="javascript:void(0)">js</a>',
    "book/b.html": '<a name="part">old-style anchor</a><a href="a.html#top">top</a>',
    "sub/index.html": '<a href="../book/b.html">b</a>',
    "_static/style.css": "",
    # a theme's Jinja macro file, copied verbatim into _static/: its "links" are template text
    "_static/macros.html": "<link href=\"{{ pathto('_static/style.css', 1) }}?d=1\">",
}


def test_broken_internal_links_passes_a_clean_tree(tmp_path):
    assert browser.broken_internal_links(write_pages(tmp_path, CLEAN_TREE)) == []


def test_broken_internal_links_names_a_missing_page_and_a_missing_anchor(tmp_path):
    tree = dict(CLEAN_TREE)
    tree["book/a.html"] += ('<a href="gone.html">gone</a><a href="b.html#nowhere">x</a>'
                            '<a href="#absent">y</a><img src="../_images/lost.png">'
                            '<a href="../../outside.html">up</a>')
    tree["book/b.html"] += '<a href="/book/a.html">root</a><a href="file:///etc/passwd">f</a>'
    tree["_static/vendor.html"] = '<a href="missing.js">a broken link, not a template</a>'
    assert browser.broken_internal_links(write_pages(tmp_path, tree)) == [
        "_static/vendor.html -> missing.js (no file _static/missing.js)",
        "book/a.html -> gone.html (no file book/gone.html)",
        "book/a.html -> b.html#nowhere (no id 'nowhere' in book/b.html)",
        "book/a.html -> #absent (no id 'absent' in book/a.html)",
        "book/a.html -> ../_images/lost.png (no file _images/lost.png)",
        "book/a.html -> ../../outside.html (outside the html tree)",
        "book/b.html -> /book/a.html (root-absolute: breaks when the book is not served at /)",
        "book/b.html -> file:///etc/passwd (scheme 'file' is not part of the book)",
    ]


# ---- the book ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def book_html(reference_book):
    """The book built from the reference run (tests/conftest.py, once a session): html root."""
    return reference_book


@pytest.fixture(scope="module")
def book_url(book_html):
    with browser.serve(book_html) as base:
        yield base


def book_pages(html_root) -> list[str]:
    """Every page of the built book, as paths under its html root: each .html file but the
    theme's templates copied under _static/ and a redirect (the root index.html, a meta refresh
    to the landing page, which is itself a page)."""
    pages = []
    for path in sorted(html_root.rglob("*.html")):
        page = path.relative_to(html_root).as_posix()
        head = path.read_text(encoding="utf-8", errors="replace")[:2000].lower()
        if page.startswith("_static/") or 'http-equiv="refresh"' in head:
            continue
        pages.append(page)
    return pages


def page_problems(driver, page: str, size: str) -> tuple[dict[str, list[str]], int]:
    """Every check of the loaded page (its dropdowns opened first), and how many tables it has."""
    browser.open_details(driver)
    tables = browser.table_widths(driver)
    problems = {"page": not_a_book_page(driver), "width": browser.page_width_problems(driver),
                "tables": browser.wide_tables(driver), "images": browser.broken_images(driver),
                "console": browser.console_errors(driver),
                "links out": browser.external_link_problems(driver)}
    if size == "window":  # cards are for phones and recorded notebook frames
        problems["tables"] += [f"table ({t['name']}) fits only as cards"
                               for t in browser.stacked_tables(driver) if not t["recorded"]]
    if page == PAGES["results"]:
        problems["results"] = results_page_problems(driver)
    return {check: found for check, found in problems.items() if found}, len(tables)


@pytest.fixture(scope="module")
def phone():
    browser.require_browser(os.environ)
    with browser.chromium(*browser.PHONE, phone=True) as started:
        yield started


@pytest.mark.parametrize("size", SIZES)
def test_every_page_of_the_book_fits_and_loads_whole(request, capsys, book_html, book_url, size):
    pages = book_pages(book_html)
    assert set(PAGES.values()) <= set(pages), "a page a reader must find is not in the book"
    driver = request.getfixturevalue("driver" if size == "window" else "phone")
    width, height = SIZES[size]
    assert driver.execute_script("return document.documentElement.clientWidth") <= width
    started, tables, failed = time.monotonic(), 0, {}
    for page in pages:
        browser.load(driver, book_url + page)
        problems, count = page_problems(driver, page, size)
        tables += count
        if problems:
            failed[page] = problems
            browser.screenshot(driver, ARTIFACTS / size / (page.replace("/", "_") + ".png"))
    with capsys.disabled():
        print(f"\nbrowser, {size} {width}x{height}: {len(pages)} pages, {tables} tables checked "
              f"in {time.monotonic() - started:.1f} s", flush=True)
    assert len(pages) > len(PAGES) and tables > 0  # a check that measured nothing fails
    assert failed == {}, f"{len(failed)} of {len(pages)} pages at {width}x{height} " + "\n".join(
        f"{page}: {problems}" for page, problems in failed.items())


def test_every_internal_link_of_the_book_resolves(book_html):
    assert len(list(book_html.rglob("*.html"))) > len(PAGES)
    assert browser.broken_internal_links(book_html) == []
