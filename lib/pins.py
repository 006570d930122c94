"""The pins file (pins.yaml at the repository root): the single source of truth for every root."""
from __future__ import annotations

import hashlib
from pathlib import Path

import yaml

PINS_PATH = Path(__file__).resolve().parents[1] / "pins.yaml"


def load(path: Path = PINS_PATH) -> dict:
    with open(path, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def digest(path: Path = PINS_PATH) -> str | None:
    """sha256 of the pins file as committed, recorded in every run.json."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if Path(path).exists() else None
