"""lib/places by concern (issue 42): the kube and slurm places are packages, and no class under
lib/places inherits from more than one class (what a place shares with a helper is held by
composition: a KubePlace hands itself to lib.places.kube.serve/waits/aiperf, a SlurmPlace holds
its SlurmServing, each plan holds its lib.places.planning.Planning)."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import lib.places


def places_modules() -> list:
    """Every module under lib/places, imported (the package itself first)."""
    found = [lib.places]
    for info in pkgutil.walk_packages(lib.places.__path__, "lib.places."):
        found.append(importlib.import_module(info.name))
    return found


def test_kube_and_slurm_are_packages():
    for name in ("lib.places.kube", "lib.places.slurm", "lib.places.kube.manifests"):
        module = importlib.import_module(name)
        assert hasattr(module, "__path__"), f"{name} is not a package"
    names = {m.__name__ for m in places_modules()}
    assert {"lib.places.kube.place", "lib.places.kube.plan", "lib.places.slurm.place",
            "lib.places.slurm.plan", "lib.places.slurm.sbatch"} <= names
    # the old flat modules are gone, with no alias left at their paths
    assert not names & {"lib.places.kube_pods", "lib.places.kube_plan", "lib.places.batch",
                        "lib.places.slurm_serve", "lib.places.slurm_plan", "lib.places.plan",
                        "lib.places.manifests"}


def test_no_class_under_lib_places_has_more_than_one_base():
    classes = {f"{cls.__module__}.{cls.__qualname__}": cls for module in places_modules()
               for _, cls in inspect.getmembers(module, inspect.isclass)
               if cls.__module__.startswith("lib.places")}
    assert len(classes) > 20
    assert {name: [b.__name__ for b in cls.__bases__] for name, cls in classes.items()
            if len(cls.__bases__) != 1} == {}
    # a plan is its place with the door in plan mode: no plan class is a place
    from lib.places.base import Place
    from lib.places.kube.plan import KubePlanned
    from lib.places.slurm.plan import SlurmPlanned
    assert not issubclass(KubePlanned, Place) and not issubclass(SlurmPlanned, Place)
