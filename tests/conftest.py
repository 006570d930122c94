"""Suite-wide: the door's table of cluster identities (lib.core.identities) goes to a folder of
this session's own, never the user's ~/.local/state, and is removed after."""
import os
import shutil
import tempfile

from lib.core.identities import STATE_DIR_ENV

_TABLES = tempfile.mkdtemp(prefix="repro-identities-")
os.environ[STATE_DIR_ENV] = _TABLES  # papermill's kernels and every subprocess inherit it


def pytest_unconfigure(config):
    shutil.rmtree(_TABLES, ignore_errors=True)
