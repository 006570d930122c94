"""The book's stylesheet for tables (book/_static/tables.css: why is written there), added to
every page. An extension, not `html_static_path` in _config.yml: Jupyter Book 1.x sets that
list itself, and the staged book (lib.publish.book) keeps book/ as one folder."""
from pathlib import Path

STATIC = Path(__file__).resolve().parent.parent / "_static"


def add_static(app):
    app.config.html_static_path.append(str(STATIC))


def setup(app):
    app.connect("builder-inited", add_static)
    app.add_css_file("tables.css")
    return {"parallel_read_safe": True, "parallel_write_safe": True}
