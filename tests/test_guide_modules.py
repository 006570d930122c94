"""The guide's files a rank job names (lib.places.base.RankJob.modules) are all its processes
import of the guide: each job's entry module is imported in a fresh interpreter whose sys.path
holds only a folder with those files (as the kube place's ConfigMap lays them out under
/opt/guide) and the interpreter's own site-packages, never the checkout; every `lib` module it
ends up with must come from that folder. 07's rank imports lib.bench.megatron_shims inside its
main (after torch), so that module is imported too."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest

from lib.engines import deepep
from lib.places.kube.files import guide_files
from lib.stages import train

# The check, run in the fresh interpreter (-I: no PYTHONPATH, no user site, no script folder on
# sys.path): import the entry modules, then report where every lib module came from.
CHECK = """
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
for name in sys.argv[2:]:
    importlib.import_module(name)
print(json.dumps({n: getattr(m, '__file__', None) for n, m in sys.modules.items()
                  if n == 'lib' or n.startswith('lib.')}))
"""


@pytest.mark.parametrize("paths, entries", [
    (train.TRAIN_MODULES, ["lib.bench.moe_train", "lib.bench.megatron_shims"]),
    (deepep.TEST_EP_MODULES, [deepep.TEST_EP_RANK_MODULE]),
], ids=["07 megatron training", "03 test_ep under torchrun"])
def test_a_job_s_modules_are_all_its_ranks_import_of_the_guide(tmp_path, paths, entries):
    folder = tmp_path / "guide"
    for path, text in guide_files(paths).items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    done = subprocess.run([sys.executable, "-I", "-c", CHECK, str(folder), *entries],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(entries) <= set(loaded)
    outside = {n: f for n, f in loaded.items() if not str(f).startswith(str(folder))}
    assert outside == {}, outside
    assert {str(Path(f).relative_to(folder)) for f in loaded.values()} == set(paths)


@pytest.mark.parametrize("paths", [train.TRAIN_MODULES, deepep.TEST_EP_MODULES],
                         ids=["07 megatron training", "03 test_ep under torchrun"])
def test_a_job_s_modules_are_files_of_the_checkout_with_every_package_s_init(paths):
    """A RankJob's `modules` are the guide's own lists (nothing below the stage checks them):
    relative POSIX paths of .py files of the checkout, inside it, every package's __init__.py
    named beside its modules (without it the import would fail in the pods)."""
    root = Path(__file__).resolve().parents[1]
    for path in paths:
        rel = PurePosixPath(path)
        assert not rel.is_absolute() and ".." not in rel.parts and rel.suffix == ".py", path
        assert str(rel) == path and (root / rel).is_file(), path
        for package in rel.parents:
            if str(package) != ".":
                assert f"{package}/__init__.py" in paths, (path, package)
    assert list(guide_files(paths)) == list(paths)  # read in the order given
