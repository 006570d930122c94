"""The book in a real browser: a static server, Debian's headless Chromium, and checks.

Each check returns a list of problems, empty when all is well, so a test asserts `== []` and a
failure prints what is wrong. The browser is Debian's (scripts/chromium.sh install), driven
through Debian's chromedriver: both paths are given to Selenium, so Selenium Manager, which
would download a browser of its own, is never started.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator, Mapping
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
REQUIRED_ENV = "REPRO_BROWSER_REQUIRED"
INSTALL_HINT = "scripts/chromium.sh install"
PAGE_LOAD_TIMEOUT_S = 30
# The window the book is read in (the 1400-pixel window): every check runs at this size,
# and no table may be wider than what it leaves the page's main column (table_widths).
WINDOW = (1400, 900)
# ...and the phone it is read on (a 390 x 844 CSS-pixel screen): headless Chromium will not
# open a window narrower than 500 px, so the phone is emulated (chromium(..., phone=True)).
PHONE = (390, 844)
IMAGE_WAIT_MS = 10_000
# A longer page is shot down to here: Chromium draws at most 16384 px, and a 36000 px PNG takes
# seconds to write and cannot be looked at anyway.
MAX_SHOT_HEIGHT = 12_000


def missing_browser(env: Mapping[str, str], chromium: Path | None = None,
                    chromedriver: Path | None = None) -> tuple[str, str] | None:
    """None when both binaries are there (CHROMIUM, CHROMEDRIVER unless given); else ("skip" or
    "fail", the reason): "fail" when REPRO_BROWSER_REQUIRED=1 (the Makefile sets it), so CI never
    skips silently."""
    binaries = (chromium or CHROMIUM, chromedriver or CHROMEDRIVER)
    missing = [str(p) for p in binaries if not p.is_file()]
    if not missing:
        return None
    verdict = "fail" if env.get(REQUIRED_ENV) == "1" else "skip"
    why = f"{' and '.join(missing)} missing (install: {INSTALL_HINT})"
    if verdict == "fail":
        why += f"; {REQUIRED_ENV}=1 forbids skipping"
    return verdict, why


def require_browser(env: Mapping[str, str], chromium: Path | None = None,
                    chromedriver: Path | None = None) -> None:
    """Skip the test, or fail it under REPRO_BROWSER_REQUIRED=1, when the browser is missing."""
    missing = missing_browser(env, chromium, chromedriver)
    if missing is None:
        return
    verdict, why = missing
    if verdict == "fail":
        pytest.fail(why, pytrace=False)
    pytest.skip(why)


@contextlib.contextmanager
def serve(directory: Path) -> Iterator[str]:
    """Serve `directory` on 127.0.0.1 at a free port; yields the base URL, ending in '/'."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="browser-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass  # one line per request would drown pytest's output


# Headless Chromium's narrowest window: a narrower size is given by emulating a phone.
NARROWEST_WINDOW = 500


@contextlib.contextmanager
def chromium(width: int = WINDOW[0], height: int = WINDOW[1], phone: bool = False):
    """Headless Chromium through chromedriver, its browser console log kept (get_log).

    phone=True emulates a phone's screen of width x height CSS pixels (DevTools' device
    metrics, `mobile`): a layout viewport of the device's width, the page's meta viewport
    honoured and scrollbars that take no room, as a phone lays a page out. A page wider than
    the phone then widens window.innerWidth with it, so page widths are measured against the
    document's clientWidth (page_width_problems)."""
    # imported here: the static link crawl and the skip rule need no selenium
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                # no network beyond 127.0.0.1 here: no update checks, no field trials
                "--disable-background-networking", "--disable-component-update",
                f"--window-size={max(width, NARROWEST_WINDOW)},{height}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)),
                              options=options)
    try:
        driver.set_page_load_timeout(PAGE_LOAD_TIMEOUT_S)
        if phone:
            emulate_phone(driver, width, height)
        yield driver
    finally:
        driver.quit()


def emulate_phone(driver, width: int, height: int) -> None:
    """The page laid out on a phone's screen of width x height CSS pixels (chromium(phone=True));
    it holds for every page this driver loads after."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": width, "height": height, "deviceScaleFactor": 1, "mobile": True})
    driver.emulated_phone = (width, height)


def load(driver, url: str) -> None:
    """Open `url` with an empty console log, so console_errors sees this page's entries only."""
    driver.get_log("browser")  # get_log drains: what an earlier page left goes here
    driver.get(url)  # returns after the load event
    phone = getattr(driver, "emulated_phone", None)
    if phone:
        settle_on_phone_width(driver, phone[0])


# A page of a new origin gets a renderer of its own; under load it was seen laid out at another
# width when its load event fired (a test on a busy machine read no stacked table where an idle
# one reads two), the emulated screen's resize coming later and the book's script re-fitting
# its tables 100 ms after that (book/_ext/table_fit.py).
PHONE_SETTLE_S = 5.0
REFIT_AFTER_RESIZE_S = 0.3


def settle_on_phone_width(driver, width: int) -> None:
    """Until the page is laid out at the emulated phone's width; if it had to wait, until the
    book's script has fitted the tables again."""
    deadline, waited = time.monotonic() + PHONE_SETTLE_S, False
    while driver.execute_script("return document.documentElement.clientWidth") > width:
        if time.monotonic() > deadline:
            raise AssertionError(f"the page was never laid out at the phone's {width} px")
        waited = True
        time.sleep(0.05)
    if waited:
        time.sleep(REFIT_AFTER_RESIZE_S)


def screenshot(driver, path: Path) -> Path:
    """The whole page, up to MAX_SHOT_HEIGHT px: the window is stretched to the page's height for
    the shot, then given back its size. (DevTools' captureBeyondViewport lays this theme out
    again, at another width, and the shot shows the page cut on its left.)"""
    page = driver.execute_script("return document.documentElement.scrollHeight")
    path.parent.mkdir(parents=True, exist_ok=True)
    phone = getattr(driver, "emulated_phone", None)
    if phone:  # the emulated screen, not the window, is what is drawn: stretch the screen
        try:
            emulate_phone(driver, phone[0], min(page, MAX_SHOT_HEIGHT))
            driver.save_screenshot(str(path))
        finally:
            emulate_phone(driver, *phone)
        return path
    width, height = driver.get_window_size()["width"], driver.get_window_size()["height"]
    chrome = height - driver.execute_script("return window.innerHeight")
    try:
        driver.set_window_size(width, min(page, MAX_SHOT_HEIGHT) + chrome)
        driver.save_screenshot(str(path))
    finally:
        driver.set_window_size(width, height)
    return path


_SETTLE_IMAGES = """
const done = arguments[arguments.length - 1];
const images = Array.from(document.images);
images.forEach(img => { img.loading = "eager"; });  // a lazy image below the fold loads too
const settled = images.map(img => img.complete ? null : new Promise(resolve => {
  img.addEventListener("load", resolve, {once: true});
  img.addEventListener("error", resolve, {once: true});
}));
Promise.race([Promise.all(settled), new Promise(r => setTimeout(r, arguments[0]))]).then(() =>
  done(images.map(img => [img.getAttribute("src"), img.complete, img.naturalWidth])));
"""


def broken_images(driver) -> list[str]:
    """Every <img> of the loaded page is complete with naturalWidth > 0 (one still loading
    after IMAGE_WAIT_MS counts as broken)."""
    driver.set_script_timeout(IMAGE_WAIT_MS / 1000 + 5)
    states = driver.execute_async_script(_SETTLE_IMAGES, IMAGE_WAIT_MS)
    return [f"{src} (complete={complete}, naturalWidth={width})"
            for src, complete, width in states if not (complete and width > 0)]


def console_errors(driver) -> list[str]:
    """The SEVERE entries of the browser console since the last load() (uncaught exceptions,
    console.error, failed requests), but the browser's own /favicon.ico probe (severe_messages).

    Chromium hands an entry to chromedriver a moment after the page logged it (an uncaught
    error on a loaded machine was read as none once in a make test): the log is read again
    after a round trip to the page, until a read brings nothing new (at most SETTLE_READS)."""
    entries = driver.get_log("browser")
    for _ in range(SETTLE_READS):
        driver.execute_script("return document.readyState")
        more = driver.get_log("browser")
        if not more and entries:
            break
        entries += more
    return severe_messages(entries, driver.current_url)


SETTLE_READS = 3


def severe_messages(entries: list[dict], page_url: str) -> list[str]:
    """The messages of the SEVERE entries, less the 404 of the page origin's /favicon.ico.

    Chromium asks every origin for /favicon.ico by itself when a page declares no icon, and
    logs the 404 whenever the answer arrives, on this page or the next: no page asked for it.
    A page that links /favicon.ico itself is caught by broken_internal_links (root-absolute)."""
    probe = "{0.scheme}://{0.netloc}/favicon.ico - ".format(urlsplit(page_url))
    return [entry["message"] for entry in entries
            if entry["level"] == "SEVERE" and not entry["message"].startswith(probe)]


# Per <table>: its width (the larger of its box and its scrollWidth: content can overflow the
# box), the width it may take (its scroll container's or parent's inner width, and no further
# than the window's right edge), and its first row's text to name it.
_TABLE_WIDTHS = """
const viewport = document.documentElement.clientWidth;
return Array.from(document.querySelectorAll("table")).map(table => {
  const box = table.getBoundingClientRect();
  const holder = table.parentElement;
  const first = (table.rows[0] || table).innerText || "";
  return {width: Math.ceil(Math.max(box.width, table.scrollWidth)),
          room: Math.floor(Math.min(holder.clientWidth, viewport - box.left)),
          name: first.replace(/\\s+/g, " ").trim().slice(0, 50)};
});
"""


def table_widths(driver) -> list[dict]:
    """Every table of the loaded page: {width, room, name} in CSS pixels."""
    return driver.execute_script(_TABLE_WIDTHS)


def wide_tables(driver) -> list[str]:
    """Every table of the loaded page fits the room it has: no wider than the element holding it
    (pydata-sphinx-theme's scroll container, whose overflow a reader would scroll sideways) nor
    past the window's right edge. Problems read "table N (its first row): W px in R px"."""
    return [f"table {i} ({t['name']}): {t['width']} px in {t['room']} px"
            for i, t in enumerate(table_widths(driver), start=1) if t["width"] > t["room"]]


# Every <details> of the loaded page opened (a dropdown, a folded code cell: a reader opens them,
# and a closed one has no width to measure), then two animation frames, so that what runs on
# their `toggle` event (book/_ext/table_fit.py's script) has laid them out.
_OPEN_DETAILS = """
const done = arguments[arguments.length - 1];
const details = Array.from(document.querySelectorAll("details"));
details.forEach(d => { d.open = true; });
if (details.length === 0) done(0);
else requestAnimationFrame(() => requestAnimationFrame(() => done(details.length)));
"""


def open_details(driver) -> int:
    """Open every <details> of the loaded page; how many there were."""
    return driver.execute_async_script(_OPEN_DETAILS)


# The document's width against the room the window gives it (clientWidth: the window less its
# scrollbar; on an emulated phone the device's width, where innerWidth grows with a page wider
# than the phone), and the deepest elements sticking out past it, to say what is too wide.
_PAGE_WIDTH = """
const room = document.documentElement.clientWidth;
const out = [];
for (const el of document.querySelectorAll("body *")) {
  const box = el.getBoundingClientRect();
  if (box.width === 0 || box.right <= room + 1) continue;
  if (Array.from(el.children).some(c => c.getBoundingClientRect().right > room + 1)) continue;
  const name = el.tagName.toLowerCase() + (el.className && el.className.baseVal === undefined
                                           ? "." + el.className.trim().split(/\\s+/)[0] : "");
  out.push(name + " '" + (el.innerText || el.textContent || "").replace(/\\s+/g, " ").trim()
           .slice(0, 40) + "' to " + Math.ceil(box.right) + " px");
}
return {width: document.documentElement.scrollWidth, room: room, sticking_out: out.slice(0, 3)};
"""


def page_width_problems(driver) -> list[str]:
    """The loaded page is no wider than the window: the reader never scrolls it sideways. A
    problem reads "page: W px wide in R px (the elements sticking out)"."""
    measured = driver.execute_script(_PAGE_WIDTH)
    if measured["width"] <= measured["room"]:
        return []
    return [f"page: {measured['width']} px wide in {measured['room']} px ("
            + "; ".join(measured["sticking_out"]) + ")"]


# The tables book/_ext/table_fit.py's script laid out as cards (one per row): on a phone that is
# how a wide table fits; in the 1400-pixel window a table of the book's own fits as a table.
_STACKED = """
return Array.from(document.querySelectorAll("table.table-stacked")).map(table => ({
  // its first row's cells, read as text: a stacked table's head is not rendered (no innerText)
  name: Array.from((table.rows[0] || {cells: []}).cells, c => c.textContent.trim()).join(" ")
    .replace(/\\s+/g, " ").slice(0, 50),
  recorded: table.closest(".cell_output") !== null}));
"""


def stacked_tables(driver) -> list[dict]:
    """Every table of the loaded page shown as cards: {name, recorded} (recorded: a notebook's
    output, a frame the run wrote, not a table the book lays out)."""
    return driver.execute_script(_STACKED)


_HREFS = 'return Array.from(document.querySelectorAll("a[href]"), a => a.getAttribute("href"));'
# Hosts that are the reader's own machine: a link to one is an example address, not a link out.
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0"})


def malformed_external_links(hrefs: list[str], book_host: str = "") -> list[str]:
    """Every link out of the book is well formed: https, a host name (with a dot) and a path.
    A relative link, a fragment, a link to the book's own host or to the reader's machine
    (http://127.0.0.1:8000/...) is not a link out; mailto: and the like are not checked."""
    problems = []
    for href in hrefs:
        parts = urlsplit(href.strip())
        if parts.scheme and parts.scheme.lower() not in ("http", "https"):
            continue
        if not parts.scheme and not href.strip().startswith("//"):
            continue  # relative: broken_internal_links checks it
        try:
            host = (parts.hostname or "").lower()
        except ValueError:
            host = ""
        if host in LOCAL_HOSTS or (book_host and parts.netloc == book_host):
            continue
        why = [what for what, bad in (
            ("not https", parts.scheme.lower() != "https"),
            ("no host", not host),
            ("a host without a dot", bool(host) and "." not in host),
            ("no path", not parts.path),
            ("a space in it", any(c.isspace() for c in href.strip()))) if bad]
        if why:
            problems.append(f"{href} ({', '.join(why)})")
    return problems


def external_link_problems(driver) -> list[str]:
    """malformed_external_links of the loaded page's <a href>s."""
    return malformed_external_links(driver.execute_script(_HREFS),
                                    urlsplit(driver.current_url).netloc)


# Links with these schemes leave the book: not checked. Any other scheme (file:, ...) is
# reported, as is a root-absolute path: both break once the book is served elsewhere.
EXTERNAL_SCHEMES = frozenset({"http", "https", "mailto", "data", "javascript"})
# Files under _static/ that are not pages: pydata-sphinx-theme's webpack-macros.html and
# sphinx-book-theme's sbt-webpack-macros.html are Jinja macro templates that Sphinx copies
# verbatim as static files. Their `{{ pathto(...) }}` "links" are template expressions, not
# URLs; once rendered into a page they are checked there like every other link.
_TEMPLATE_MARK = "{{"


class _PageParser(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.anchors: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        values = dict(attrs)
        if values.get("id"):
            self.anchors.add(values["id"])
        if tag == "a" and values.get("name"):  # HTML's older anchor form
            self.anchors.add(values["name"])
        for name in ("href", "src"):
            if values.get(name) is not None:
                self.links.append(values[name])
        if tag == "meta" and (values.get("http-equiv") or "").lower() == "refresh":
            _, _, target = (values.get("content") or "").partition("url=")
            if target:  # index.html is only such a redirect
                self.links.append(target.strip())

    handle_startendtag = handle_starttag


def _parse(page: Path) -> _PageParser:
    parser = _PageParser()
    parser.feed(page.read_text(encoding="utf-8", errors="replace"))
    parser.close()
    return parser


def broken_internal_links(html_root: Path) -> list[str]:
    """Static crawl of every .html under html_root: each relative href/src resolves to a file
    under html_root, and its #fragment is an id (or <a name>) of the target page (this page
    for a bare '#x'). Problems read "page -> link (why)"."""
    root = Path(html_root).resolve()
    pages = {p.resolve(): _parse(p) for p in sorted(root.rglob("*.html"))}
    problems = []
    for page, parsed in pages.items():
        shown = page.relative_to(root).as_posix()
        for link in parsed.links:
            why = _link_problem(root, page, link, pages)
            if why and not (shown.startswith("_static/") and _TEMPLATE_MARK in link):
                problems.append(f"{shown} -> {link} ({why})")
    return problems


def _link_problem(root: Path, page: Path, link: str, pages: dict) -> str | None:
    parts = urlsplit(link.strip())
    if parts.netloc and not parts.scheme:  # //host/path: http(s) on another host
        return None
    if parts.scheme:
        if parts.scheme.lower() in EXTERNAL_SCHEMES:
            return None
        return f"scheme {parts.scheme!r} is not part of the book"
    if parts.path.startswith("/"):
        return "root-absolute: breaks when the book is not served at /"
    target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
    if not target.is_relative_to(root):
        return "outside the html tree"
    if target.is_dir():
        target = target / "index.html"
    if not target.is_file():
        return f"no file {target.relative_to(root).as_posix()}"
    fragment = unquote(parts.fragment)
    if not fragment or target.suffix != ".html":
        return None
    if fragment.lower() == "top":  # HTML: '#top' scrolls to the top without any id
        return None
    anchors = (pages.get(target) or _parse(target)).anchors
    if fragment not in anchors:
        return f"no id {fragment!r} in {target.relative_to(root).as_posix()}"
    return None
