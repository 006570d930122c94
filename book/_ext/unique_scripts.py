"""Each inline <script> once per page: Sphinx 7.4 adds an extension's inline script twice when it
is added after the builder started (fixed upstream in Sphinx 8.2.3, sphinx-doc/sphinx#13402), and
sphinx-thebe's `const THEBE_JS_URL` declared twice throws a SyntaxError on every page."""


def unique_scripts(app, pagename, templatename, context, doctree):
    seen = set()
    unique = []
    for script in context.get("script_files", []):
        key = (script.filename or "", tuple(sorted(script.attributes.items())))
        if key not in seen:
            seen.add(key)
            unique.append(script)
    # in place: the builder restores its own list after each page, and later handlers of this
    # event append to it
    context["script_files"][:] = unique


def setup(app):
    app.connect("html-page-context", unique_scripts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
