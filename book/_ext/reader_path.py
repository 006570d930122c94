"""The sidebar is the reader's path: the chapters only (the landing, results, running it on a
cluster, the stages, coverage, comparison, bounds, troubleshooting, parameters, the appendix).
A stage's page is reached from the stages' page and the previous/next buttons, a run's page from
the appendix. Besides reading better, it is most of the build's time saved: the theme renders
the sidebar's tree once per page, and with every run's page in it that was 8 of 33 seconds."""


def chapters_only(app, config):
    config.html_theme_options = {**config.html_theme_options, "max_navbar_depth": 1,
                                 "show_navbar_depth": 1}


def setup(app):
    app.connect("config-inited", chapters_only)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
