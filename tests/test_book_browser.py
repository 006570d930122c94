"""The published book in a real browser: Debian's headless Chromium on a real HTTP server.

Each check's FAIL path first, on small pages written here and served for real; then the book,
built from the reference run, page by page (loaded, no broken image, no console error, a
screenshot kept under _build/test-artifacts/browser/), every table of the landing, results,
coverage and comparison pages within what a 1400-pixel window leaves it, and every internal link
of its html tree.

Without /usr/bin/chromium (scripts/chromium.sh install) the browser tests skip with the reason,
unless REPRO_BROWSER_REQUIRED=1 (the Makefile's `unit`), where they fail.
"""
import os
import re
import time

import pytest

from lib.core.door import REPO_ROOT
from tests import browser

REFERENCE = (REPO_ROOT / "results" / "REFERENCE").read_text().strip()
ARTIFACTS = REPO_ROOT / "_build" / "test-artifacts" / "browser"
# The book's pages a reader must reach, by the name of their screenshot: the contract with the
# book's page layout (results gets table-and-image checks of its own).
PAGES = {
    "landing": "book/intro.html",
    "results": "book/results.html",
    "stage": "book/stages/04_serve.html",
    "appendix": "book/history.html",
    "run": f"book/runs/{REFERENCE}.html",
}
# The pages whose tables must fit a 1400-pixel window, with the fewest tables each must have (a
# check that measured nothing would pass): the landing page answers in prose, no table.
FITTING_PAGES = {"landing": ("book/intro.html", 0), "results": ("book/results.html", 4),
                 "coverage": ("book/coverage.html", 3), "comparison": ("book/comparison.html", 2)}
# pydata-sphinx-theme's main column; python's http.server titles its 404 "Error response".
MAIN_CONTENT = "main#main-content article"
ERROR_TITLE = re.compile(r"^\s*$|\b404\b|error response|not found", re.IGNORECASE)


def not_a_book_page(driver) -> list[str]:
    """The page loaded: a title that is not an error page's, and a main content with text."""
    from selenium.webdriver.common.by import By

    problems = []
    if ERROR_TITLE.search(driver.title):
        problems.append(f"title {driver.title!r}: empty or an error page's")
    main = driver.find_elements(By.CSS_SELECTOR, MAIN_CONTENT)
    if not main:
        problems.append(f"no main content ({MAIN_CONTENT})")
    elif not main[0].text.strip():
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


# A table in a column as the theme builds one: a 600 px column, the theme's scroll container
# around each table, and Sphinx's inline code (<code><span class="pre">), kept unbroken.
COLUMN = ('<title>t</title><style>article {width: 600px} '
          '.pst-scrollable-table-container {overflow-x: auto} '
          'span.pre {white-space: nowrap}</style>')
# four columns of run ids: each unbroken, the row is wider than the column
RUN_IDS = "".join('<td><code class="literal"><span class="pre">gpu-2xh200-deepep-vllm-2026113'
                  f'{i}</span></code></td>' for i in range(4))


def in_column(table: str, stylesheet: str = "") -> str:
    return (COLUMN + stylesheet + '<article><div class="pst-scrollable-table-container">'
            + table + "</div></article>")


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


@pytest.mark.parametrize("name", PAGES)
def test_a_book_page_loads_whole(driver, book_url, name):
    browser.load(driver, book_url + PAGES[name])
    problems = {"page": not_a_book_page(driver), "images": browser.broken_images(driver),
                "console": browser.console_errors(driver)}
    if name == "results":
        problems["results"] = results_page_problems(driver)
    browser.screenshot(driver, ARTIFACTS / f"{name}.png")  # before the verdict: kept on a FAIL
    assert problems == {check: [] for check in problems}, PAGES[name]


@pytest.mark.parametrize("name", FITTING_PAGES)
def test_no_table_of_a_page_is_wider_than_a_1400_pixel_window(driver, book_url, name):
    page, fewest = FITTING_PAGES[name]
    browser.load(driver, book_url + page)
    assert driver.execute_script("return window.innerWidth") == browser.WINDOW[0]
    assert len(browser.table_widths(driver)) >= fewest, page
    assert browser.wide_tables(driver) == [], page


def test_every_internal_link_of_the_book_resolves(book_html):
    assert len(list(book_html.rglob("*.html"))) > len(PAGES)
    assert browser.broken_internal_links(book_html) == []
