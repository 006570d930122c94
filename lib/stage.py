"""Alias kept for recorded notebooks: every executed notebook under results/ begins with
``from lib.stage import open_stage`` (the opener is lib.stages.opening now). Listed with the
other aliases in lib/ALIASES.md."""
from lib.stages.opening import open_stage  # noqa: F401
