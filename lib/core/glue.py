"""Glue a value into a notebook's outputs for the book (myst-nb's `glue` format, IPython only).

The same display myst_nb.glue makes (mime types under application/papermill.record/ and the
scrapbook metadata), written here so the stage notebooks execute where myst-nb is not installed
(the GPU machines) and produce byte-identical outputs everywhere.
"""
from __future__ import annotations

from typing import Any

import IPython
from IPython.display import display as ipy_display

GLUE_PREFIX = "application/papermill.record/"


def glue(name: str, value: Any, display: bool = True) -> None:
    """As myst_nb.glue: `display=False` stores the value for the book without showing it."""
    bundle, metadata = IPython.core.formatters.format_display_data(value)
    prefix = "" if display else GLUE_PREFIX
    metadata["scrapbook"] = {"name": name, "mime_prefix": prefix}
    ipy_display({prefix + k: v for k, v in bundle.items()}, raw=True, metadata=metadata)
