"""Every page fits a 1400-pixel window and a 390-pixel phone (tests/test_book_browser.py
measures it): the book's stylesheet (book/_static/tables.css: why is written there) and, for a
table that is still wider than its column, a small script that lets its words break and, where
that is not enough, lays it out as one card per row, each value under its column's name. Added
to every page.

An extension, not `html_static_path` in _config.yml: Jupyter Book 1.x sets that list itself,
and the staged book (lib.publish.book) keeps book/ as one folder. It also turns on MyST's
definition lists (`deflist`), which a run's page uses for its facts (lib.publish.appendix): in
_config.yml, `parse.myst_enable_extensions` would replace Jupyter Book's own list, not add to it.
"""
from pathlib import Path

STATIC = Path(__file__).resolve().parent.parent / "_static"

# Runs on every page, on each table of the article, in the steps tables.css describes: a table
# wider than the element holding it with its words whole gets the class `table-wrap-anywhere`
# (any word may break); one still wider gets `table-stacked`, and each of its cells a
# `data-label` naming its column (an empty cell `table-stacked-empty`), so that it shows as one
# card per row. Again when the window changes size (a phone turned) and when a dropdown opens
# (a browser may not lay out a closed one). A table that fits is left as it is.
FIT_SCRIPT = """
(function () {
  function fits(table) {
    var holder = table.parentElement;
    var room = Math.min(holder.clientWidth,
                        document.documentElement.clientWidth - table.getBoundingClientRect().left);
    return Math.max(table.getBoundingClientRect().width, table.scrollWidth) <= room + 1;
  }
  function label(table) {
    var head = table.tHead && table.tHead.rows[table.tHead.rows.length - 1];
    if (!head) { return; }
    var names = Array.prototype.map.call(head.cells, function (c) { return c.innerText.trim(); });
    Array.prototype.forEach.call(table.tBodies, function (body) {
      Array.prototype.forEach.call(body.rows, function (row) {
        Array.prototype.forEach.call(row.cells, function (cell, i) {
          if (names[i]) { cell.setAttribute("data-label", names[i]); }
          // an empty cell would be a name over nothing: a card leaves it out
          cell.classList.toggle("table-stacked-empty", cell.textContent.trim() === "");
        });
      });
    });
  }
  function fit(root) {
    (root || document).querySelectorAll(".bd-article table").forEach(function (table) {
      if (!table.offsetParent) { return; }  // hidden (a closed dropdown): fitted when opened
      table.classList.remove("table-wrap-anywhere", "table-stacked");
      if (fits(table)) { return; }
      table.classList.add("table-wrap-anywhere");
      if (fits(table)) { return; }
      label(table);
      table.classList.add("table-stacked");
    });
  }
  window.bookFitTables = fit;
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", function () { fit(); });
  } else {
    fit();
  }
  var pending;
  window.addEventListener("resize", function () {
    clearTimeout(pending);
    pending = setTimeout(function () { fit(); }, 100);
  });
  document.addEventListener("toggle", function (event) {
    if (event.target.open) { fit(event.target); }
  }, true);
})();
"""


def add_static(app):
    app.config.html_static_path.append(str(STATIC))


def enable_definition_lists(app, config):
    if "deflist" not in config.myst_enable_extensions:
        config.myst_enable_extensions = list(config.myst_enable_extensions) + ["deflist"]


def setup(app):
    app.connect("config-inited", enable_definition_lists)
    app.connect("builder-inited", add_static)
    app.add_css_file("tables.css")
    app.add_js_file(None, body=FIT_SCRIPT)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
