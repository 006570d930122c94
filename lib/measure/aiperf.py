"""AIPerf artifact reader: any AIPerf output tree -> one summary table, plus per-cell gates.

One summary schema for every sweep cell (DESIGN.md "Evidence"), whatever AIPerf wrote:

* 0.10-style single run directory (the public reproduction): ``profile_export_aiperf.json``
  (+ optionally ``inputs.json``, ``logs/aiperf.log``, ...).
* 0.13 multi-concurrency sweep: ``concurrency_<N>/`` folders, each with
  ``phases/{warmup,profiling}/profile_export_aiperf.json``, ``phase_manifest.json``,
  ``run_config.json``, ``logs/aiperf.log``; plus ``aggregate/`` and ``sweep_aggregate/`` folders
  that restate the same cells and are therefore never read as cells.
* Any tree holding many of the above.
* The public reproduction's results tree,
  ``results/<engine>-deepep-dropin-<YYYYMMDD>/<engine>/[<arm>/]aiperf-.../``: ``read_public_tree``
  reads it whole and says per row which run folder, engine and folder-name date it came from.

Conventions (documented once, here):

* A *cell directory* is a directory holding any of ``profile_export_aiperf.json``,
  ``run_config.json``, ``phase_manifest.json``, ``inputs.json`` or ``logs/aiperf.log``, that is
  not inside a ``phases/``, ``aggregate/``, ``sweep_aggregate/`` or ``logs/`` folder, and that
  does not itself contain another cell directory (a 0.13 sweep root has its own
  ``logs/aiperf.log`` but is not a cell).
* Profiling numbers only: ``phases/profiling/profile_export_aiperf.json`` is preferred over the
  top-level export, so warm-up requests are never counted.
* Arm: the ``arm`` argument if given; else from folder names, in this order:

  1. A cell folder shaped ``aiperf-<words>-c<N>[_<anything>]`` (the nearest such component from
     the cell directory up) that sits in an *arm folder* ``aiperf-<arm>`` (``repeat_<n>`` folders
     between them skipped) belongs to ``<arm>``: the public reproduction's
     ``<engine>/[<arm>/]aiperf-...`` layout, where sibling arm folders can hold cells named alike
     (``aiperf-epnc1/aiperf-deepep-vllm-epnc1-c4_isl120`` -> ``epnc1``,
     ``aiperf-epnc8/aiperf-vllm-c4_isl120`` -> ``epnc8``).
  2. Else that cell folder's whole ``<words>``: the exact inverse of the guide's own
     ``aiperf-<arm>-c<C>`` (``lib.measure.sweep.cell_dir``), so a recorded run reads back the arms
     its ``summary.csv`` holds (``aiperf-vllm-deepep-v2-decode-c4`` -> ``vllm-deepep-v2-decode``,
     ``aiperf-vllm-epnc8-c4_isl120`` -> ``vllm-epnc8``). No word is dropped: arms that differ only
     before their last dash (``vllm-eager-ep``, ``vllm-graphs-ep``) stay apart.
  3. Else the folder holding the run (for ``concurrency_<N>`` cells, the 0.13 sweep folder), less
     an ``aiperf-`` prefix (``aiperf-epnc8/concurrency_4`` -> ``epnc8``,
     ``sweep-c1-c2-c4/concurrency_4`` -> ``sweep-c1-c2-c4``). A sweep folder already is one
     arm's, so the folder above it is never read (``aiperf-0.13/sweep-c1-c2-c4`` is not arm
     ``0.13``).
* Concurrency: the profiling phase of ``input_config`` (export) or ``run_config.json``; else the
  run's variation values; else the folder name (``concurrency_<N>`` or ``...-c<N>_...``).
* Repeat: the nearest path component ``repeat_<n>`` (e.g. ``.../repeat_2/aiperf-...-c4_isl120``);
  default 1. Two cells with the same (arm, concurrency, repeat) are an error, never averaged or
  double counted.
* Requests requested: the profiling phase's ``requests`` in ``input_config`` / ``run_config.json``;
  else the log's ``Phase profiling ... started | target: N requests``.
* Requests completed means completed *without error*: ``request_count`` (0.10 and 0.13: valid
  records only); else 0.13's ``completed_request_count`` minus ``error_request_count`` (AIPerf
  derives ``completed_request_count`` as successes + errors, "Completed Requests (Success +
  Error)": a run with 11 timeouts of 24 requests exported 24 there and 13 in ``request_count``);
  else ``phase_manifest.json``'s ``successful_request_count``; else the log's ``completed=`` minus
  ``errors=`` (AIPerf's ``completed=`` counts every returned credit, errored ones included).
  So ``requests_completed + errors`` is every request AIPerf sent and got an outcome for; a request
  timed out by ``--request-timeout-seconds`` is an error (``TimeoutError``), not a cancellation.
* Errors: the largest count among the sources the run has (``error_request_count``;
  ``phase_manifest.json``; the sum of ``error_summary[].count``; the log's ``errors=``), so a
  gate never under-reports; ``errors_from`` says what each source said.
* A run where every request failed writes no ``profile_export_aiperf.json``: it still yields a row
  (``has_export`` False), with counts from the log / manifest / run_config.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

# The one summary schema. Order is the display order.
SUMMARY_COLUMNS: tuple[str, ...] = (
    "arm",                     # see the arm rule above
    "concurrency",             # profiling-phase concurrency
    "repeat",                  # from a repeat_<n> folder, default 1
    "requests_requested",      # profiling-phase request count asked for
    "requests_completed",      # completed without error (profiling phase only)
    "errors",                  # errored requests (largest count among the sources)
    "cancelled",               # cancelled requests per the log (NA without a log)
    "was_cancelled",           # the run itself was cancelled (export / phase manifest)
    "output_tps",              # output_token_throughput.avg: aggregate output tokens/s
    "output_tps_per_user",     # output_token_throughput_per_user.avg
    "ttft_p50_ms",             # time_to_first_token.p50
    "ttft_p99_ms",
    "itl_p50_ms",              # inter_token_latency.p50
    "itl_p99_ms",
    "request_latency_p50_ms",
    "input_tokens_mean",       # input_sequence_length.avg
    "output_tokens_mean",      # output_sequence_length.avg
    "osl_mismatch_count",      # requests whose output length differed from the requested one
    "aiperf_version",
    "has_export",              # False: no profile_export_aiperf.json (every request failed)
    "errors_from",             # what each error source said, e.g. "error_summary=0; log=0"
    "error_details",           # error_summary rendered: "3x [422] message; ..."
    "evidence",                # ';'-joined files read for this row
    "source",                  # the cell directory
)

_INTEGER_COLUMNS = ("concurrency", "repeat", "requests_requested", "requests_completed",
                    "errors", "cancelled", "osl_mismatch_count")
_FLOAT_COLUMNS = ("output_tps", "output_tps_per_user", "ttft_p50_ms", "ttft_p99_ms",
                  "itl_p50_ms", "itl_p99_ms", "request_latency_p50_ms",
                  "input_tokens_mean", "output_tokens_mean")
_BOOLEAN_COLUMNS = ("was_cancelled", "has_export")

EXPORT_NAME = "profile_export_aiperf.json"
LOG_RELATIVE_PATH = Path("logs") / "aiperf.log"
_CELL_MARKERS = (EXPORT_NAME, "run_config.json", "phase_manifest.json", "inputs.json")
# Folders that restate cells (aggregates), split one cell into phases, or hold logs.
_NOT_CELL_FOLDERS = frozenset({"phases", "aggregate", "sweep_aggregate", "logs"})
PROFILING = "profiling"

# Display columns for the CLI (paths and provenance strings are printed apart).
_DISPLAY_COLUMNS = tuple(c for c in SUMMARY_COLUMNS
                         if c not in ("errors_from", "error_details", "evidence", "source"))

_CELL_NAME_RE = re.compile(r"^aiperf-(?P<words>.+)-c(?P<conc>\d+)(?:_.*)?$")
_AIPERF_DIR_RE = re.compile(r"^aiperf-(?P<words>.+)$")
_CONCURRENCY_DIR_RE = re.compile(r"^concurrency_(?P<conc>\d+)$")
_REPEAT_DIR_RE = re.compile(r"^repeat_(?P<n>\d+)$")
# The public reproduction's run folder: results/<engine>-deepep-dropin-<YYYYMMDD>/.
_PUBLIC_RUN_FOLDER_RE = re.compile(r"^(?P<engine>.+?)-deepep-dropin-(?P<date>\d{8})$")
# What read_public_tree adds before SUMMARY_COLUMNS.
PUBLIC_TREE_COLUMNS: tuple[str, ...] = (
    "run_folder",              # <engine>-deepep-dropin-<YYYYMMDD>
    "engine",                  # <engine> of the run folder's name
    "date",                    # YYYY-MM-DD in the run folder's name (not always the run's date)
)
_NUMBER = r"(\d[\d,]*)"  # AIPerf formats counts with thousands separators: 1,342
# 0.10: "Phase profiling complete | ..."; 0.13: "Phase profiling (profiling) complete | ..."
_LOG_COMPLETE_RE = re.compile(
    r"Phase (?P<name>\S+)(?: \((?P<kind>\w+)\))? complete \| "
    rf"completed={_NUMBER}, cancelled={_NUMBER}, errors={_NUMBER}")
_LOG_STARTED_RE = re.compile(
    r"Phase (?P<name>\S+)(?: \((?P<kind>\w+)\))? started \|.*?target: "
    rf"{_NUMBER} requests")


# ----------------------------------------------------------------------------------------------
# Small readers
# ----------------------------------------------------------------------------------------------

def _load_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc


def _count(text: str) -> int:
    return int(text.replace(",", ""))


def _metric(export: dict[str, Any] | None, name: str, stat: str = "avg") -> float | None:
    """One statistic of one metric block ({unit, avg, p50, ...}); None when AIPerf left it out."""
    if not export:
        return None
    block = export.get(name)
    if not isinstance(block, dict):
        return None
    value = block.get(stat)
    return None if value is None else float(value)


def _is_profiling(phase: dict[str, Any]) -> bool:
    return phase.get("kind", phase.get("name")) == PROFILING or phase.get("name") == PROFILING


def _profiling_phases(config: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not config:
        return []
    return [p for p in config.get("phases") or [] if isinstance(p, dict) and _is_profiling(p)]


def _sum_or_none(values: Iterable[Any]) -> int | None:
    present = [int(v) for v in values if v is not None]
    return sum(present) if present else None


# ----------------------------------------------------------------------------------------------
# Discovery
# ----------------------------------------------------------------------------------------------

def _looks_like_cell(directory: Path) -> bool:
    return (any((directory / name).is_file() for name in _CELL_MARKERS)
            or (directory / LOG_RELATIVE_PATH).is_file())


def find_cell_dirs(root: Path) -> list[Path]:
    """Every AIPerf cell directory under ``root`` (see the module docstring for the rule)."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"AIPerf artifact path does not exist: {root}")
    if root.is_file():
        root = root.parent
    candidates = [root] if _looks_like_cell(root) else []
    for directory in sorted(p for p in root.rglob("*") if p.is_dir()):
        relative_parts = directory.relative_to(root).parts
        if _NOT_CELL_FOLDERS.intersection(relative_parts):
            continue
        if _looks_like_cell(directory):
            candidates.append(directory)
    # A directory that holds other cells (a 0.13 sweep root with its own log) is not a cell.
    return [c for c in candidates if not any(o != c and c in o.parents for o in candidates)]


# ----------------------------------------------------------------------------------------------
# Naming conventions
# ----------------------------------------------------------------------------------------------

def _arm_folder(cell_folder: Path) -> str | None:
    """``<arm>`` of the ``aiperf-<arm>`` folder holding a cell folder (repeat folders skipped)."""
    holder = cell_folder.parent
    while _REPEAT_DIR_RE.match(holder.name) and holder != holder.parent:
        holder = holder.parent
    if _CELL_NAME_RE.match(holder.name):
        return None  # a cell folder inside another one: the inner name is the cell's own
    match = _AIPERF_DIR_RE.match(holder.name)
    return match["words"] if match else None


def infer_arm(cell_dir: Path) -> str:
    """Arm from the directory names (rule in the module docstring)."""
    for component in [cell_dir, *cell_dir.parents]:
        match = _CELL_NAME_RE.match(component.name)
        if match:
            return _arm_folder(component) or match["words"]
    # A 0.13 sweep names its cells concurrency_<N>: the arm is the sweep folder's.
    holder = cell_dir.parent if _CONCURRENCY_DIR_RE.match(cell_dir.name) else cell_dir
    match = _AIPERF_DIR_RE.match(holder.name)
    return match["words"] if match else holder.name


def infer_repeat(cell_dir: Path) -> int:
    """Repeat number from the nearest ``repeat_<n>`` path component; 1 when there is none."""
    for component in [cell_dir, *cell_dir.parents]:
        match = _REPEAT_DIR_RE.match(component.name)
        if match:
            return int(match["n"])
    return 1


def _concurrency_from_name(cell_dir: Path) -> int | None:
    for regex in (_CONCURRENCY_DIR_RE, _CELL_NAME_RE):
        match = regex.match(cell_dir.name)
        if match:
            return int(match["conc"])
    return None


# ----------------------------------------------------------------------------------------------
# Log and manifest evidence
# ----------------------------------------------------------------------------------------------

def parse_aiperf_log(path: Path) -> dict[str, int | None]:
    """Profiling-phase counts from an AIPerf log: requested, completed, cancelled, errors.

    Sums over every profiling phase (0.13 can run several); warm-up phases are ignored.
    Values are None when the log has no such line.
    """
    text = Path(path).read_text(errors="replace")
    started = [m for m in _LOG_STARTED_RE.finditer(text) if _log_phase_is_profiling(m)]
    complete = [m for m in _LOG_COMPLETE_RE.finditer(text) if _log_phase_is_profiling(m)]
    return {
        "requested": _sum_or_none(_count(m.group(3)) for m in started),
        "returned": _sum_or_none(_count(m.group(3)) for m in complete),
        "cancelled": _sum_or_none(_count(m.group(4)) for m in complete),
        "errors": _sum_or_none(_count(m.group(5)) for m in complete),
    }


def _log_phase_is_profiling(match: re.Match[str]) -> bool:
    return (match["kind"] or match["name"]) == PROFILING


def _manifest_profiling(manifest: dict[str, Any] | None) -> dict[str, Any]:
    phases = [p for p in (manifest or {}).get("phases") or []
              if (p.get("phase_kind") or p.get("phase_name")) == PROFILING]
    if not phases:
        return {}
    return {
        "errors": _sum_or_none(p.get("error_request_count") for p in phases),
        "successful": _sum_or_none(p.get("successful_request_count") for p in phases),
        "total": _sum_or_none(p.get("total_request_count") for p in phases),
        "was_cancelled": any(bool(p.get("was_cancelled")) for p in phases),
        "error_summary": [e for p in phases for e in p.get("error_summary") or []],
    }


def _error_summary_total(error_summary: Any) -> int | None:
    """Sum of ``count`` over an AIPerf error_summary list; None when the key is absent."""
    if error_summary is None:
        return None
    return sum(int(entry.get("count", 0)) for entry in error_summary)


def _error_details(error_summary: list[dict[str, Any]]) -> str:
    parts = []
    for entry in error_summary:
        details = entry.get("error_details") or {}
        label = details.get("message") or details.get("type") or json.dumps(details)
        code = details.get("code")
        parts.append(f"{entry.get('count', '?')}x {f'[{code}] ' if code else ''}{label}")
    return "; ".join(parts)


# ----------------------------------------------------------------------------------------------
# One cell -> one row
# ----------------------------------------------------------------------------------------------

def _export_path(cell_dir: Path) -> Path | None:
    # Profiling phase first: the top-level 0.13 export is the same numbers today, but the
    # phase file is the one that is warm-up-free by construction.
    for candidate in (cell_dir / "phases" / PROFILING / EXPORT_NAME, cell_dir / EXPORT_NAME):
        if candidate.is_file():
            return candidate
    return None


def _requested(export_config: dict | None, run_config: dict | None, log: dict) -> int | None:
    for config in (export_config, run_config):
        requested = _sum_or_none(p.get("requests") for p in _profiling_phases(config))
        if requested is not None:
            return requested
        legacy = (config or {}).get("loadgen", {}).get("request_count")  # pre-0.10 layout
        if legacy is not None:
            return int(legacy)
    return log.get("requested")


def _concurrency(cell_dir: Path, export: dict | None, run_config_file: dict | None) -> int | None:
    configs = [(export or {}).get("input_config"), (run_config_file or {}).get("cfg")]
    for config in configs:
        values = [p.get("concurrency") for p in _profiling_phases(config)]
        values = [v for v in values if v is not None]
        if values:
            return int(values[0])
        legacy = (config or {}).get("loadgen", {}).get("concurrency")
        if legacy is not None:
            return int(legacy)
    for holder in ((export or {}).get("run_info"), (run_config_file or {}).get("variation")):
        variation = (holder or {}).get("variation_values") or (holder or {}).get("values") or {}
        if "phases.profiling.concurrency" in variation:
            return int(variation["phases.profiling.concurrency"])
    return _concurrency_from_name(cell_dir)


def _completed(export: dict | None, manifest: dict, log: dict) -> int | None:
    valid = _metric(export, "request_count")  # successes only, in 0.10 and 0.13
    if valid is not None:
        return int(valid)
    returned = _metric(export, "completed_request_count")  # 0.13: successes + errors
    if returned is not None:
        return int(returned) - int(_metric(export, "error_request_count") or 0)
    if manifest.get("successful") is not None:
        return manifest["successful"]
    if log.get("returned") is not None:
        return log["returned"] - (log.get("errors") or 0)
    return None


def _errors(export: dict | None, manifest: dict, log: dict) -> tuple[int | None, str]:
    sources = {
        "error_request_count": _metric(export, "error_request_count"),
        "phase_manifest": manifest.get("errors"),
        "error_summary": _error_summary_total((export or {}).get("error_summary")),
        "log": log.get("errors"),
    }
    known = {name: int(value) for name, value in sources.items() if value is not None}
    described = "; ".join(f"{name}={value}" for name, value in known.items())
    return (max(known.values()) if known else None), described


def _aiperf_version(cell_dir: Path, export: dict | None) -> str | None:
    # Without a summary export (every request failed) the server-metrics export may still say.
    for document in (export, _load_json(cell_dir / "server_metrics_export.json")):
        if document and document.get("aiperf_version"):
            return str(document["aiperf_version"])
    return None


def read_cell(cell_dir: Path, arm: str | None = None) -> dict[str, Any]:
    """One summary row (SUMMARY_COLUMNS) from one AIPerf cell directory."""
    cell_dir = Path(cell_dir)
    export_file = _export_path(cell_dir)
    export = _load_json(export_file) if export_file else None
    run_config_file = _load_json(cell_dir / "run_config.json")
    manifest = _manifest_profiling(_load_json(cell_dir / "phase_manifest.json"))
    log_file = cell_dir / LOG_RELATIVE_PATH
    log = parse_aiperf_log(log_file) if log_file.is_file() else {}

    errors, errors_from = _errors(export, manifest, log)
    error_summary = list((export or {}).get("error_summary") or manifest.get("error_summary") or [])
    was_cancelled = (export or {}).get("was_cancelled", manifest.get("was_cancelled"))
    osl_mismatch = _metric(export, "osl_mismatch_count")
    evidence = [p for p in (export_file, cell_dir / "run_config.json",
                            cell_dir / "phase_manifest.json", log_file) if p and p.is_file()]
    return {
        "arm": arm or infer_arm(cell_dir),
        "concurrency": _concurrency(cell_dir, export, run_config_file),
        "repeat": infer_repeat(cell_dir),
        "requests_requested": _requested((export or {}).get("input_config"),
                                         (run_config_file or {}).get("cfg"), log),
        "requests_completed": _completed(export, manifest, log),
        "errors": errors,
        "cancelled": log.get("cancelled"),
        "was_cancelled": None if was_cancelled is None else bool(was_cancelled),
        "output_tps": _metric(export, "output_token_throughput"),
        "output_tps_per_user": _metric(export, "output_token_throughput_per_user"),
        "ttft_p50_ms": _metric(export, "time_to_first_token", "p50"),
        "ttft_p99_ms": _metric(export, "time_to_first_token", "p99"),
        "itl_p50_ms": _metric(export, "inter_token_latency", "p50"),
        "itl_p99_ms": _metric(export, "inter_token_latency", "p99"),
        "request_latency_p50_ms": _metric(export, "request_latency", "p50"),
        "input_tokens_mean": _metric(export, "input_sequence_length"),
        "output_tokens_mean": _metric(export, "output_sequence_length"),
        "osl_mismatch_count": None if osl_mismatch is None else int(osl_mismatch),
        "aiperf_version": _aiperf_version(cell_dir, export),
        "has_export": export is not None,
        "errors_from": errors_from,
        "error_details": _error_details(error_summary),
        "evidence": ";".join(str(p) for p in evidence),
        "source": str(cell_dir),
    }


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------

def empty_summary() -> pd.DataFrame:
    """A summary table with no rows and the schema's columns and dtypes."""
    return _typed(pd.DataFrame(columns=list(SUMMARY_COLUMNS)))


def _typed(frame: pd.DataFrame) -> pd.DataFrame:
    frame = frame.reindex(columns=list(SUMMARY_COLUMNS))
    for column in _INTEGER_COLUMNS:
        frame[column] = pd.array(frame[column].tolist(), dtype="Int64")
    for column in _FLOAT_COLUMNS:
        frame[column] = pd.to_numeric(frame[column], errors="coerce").astype("float64")
    for column in _BOOLEAN_COLUMNS:
        frame[column] = pd.array(frame[column].tolist(), dtype="boolean")
    return frame


def read_exports(*paths: str | Path, arm: str | None = None) -> pd.DataFrame:
    """Read AIPerf artifacts under ``paths`` into one table: a row per cell and repeat.

    Raises FileNotFoundError for a path that does not exist, ValueError for a path with no
    AIPerf artifacts or for two cells claiming the same (arm, concurrency, repeat).
    """
    if not paths:
        raise ValueError("read_exports needs at least one path")
    cell_dirs: dict[Path, None] = {}
    for path in paths:
        found = find_cell_dirs(Path(path))
        if not found:
            raise ValueError(f"no AIPerf artifacts under {path} (looked for {EXPORT_NAME}, "
                             f"run_config.json, phase_manifest.json, inputs.json, logs/aiperf.log)")
        cell_dirs.update((d.resolve(), None) for d in found)
    rows = [read_cell(d, arm=arm) for d in cell_dirs]
    _refuse_duplicate_cells(rows)
    frame = _typed(pd.DataFrame(rows))
    return frame.sort_values(["arm", "concurrency", "repeat"], na_position="last",
                             ignore_index=True)


def read_public_tree(root: str | Path) -> pd.DataFrame:
    """The public reproduction's results tree, whole: PUBLIC_TREE_COLUMNS + SUMMARY_COLUMNS.

    ``root`` is the ``results/`` folder holding ``<engine>-deepep-dropin-<YYYYMMDD>/`` run folders,
    or one run folder. Each run folder is read by ``read_exports`` on its own, so a repeated
    (arm, concurrency, repeat) is refused within a run folder, never across two engines' folders
    that name their arms alike. ``date`` is the date in the folder's name, which is not always
    the run's (the public ``vllm-deepep-dropin-20260706`` holds runs of 2026-07-07). Run folders
    without AIPerf artifacts (a microbenchmark alone) give no rows.

    Raises FileNotFoundError for a missing root, ValueError for a root with no run folder holding
    AIPerf artifacts or with AIPerf cells outside every run folder (they would go unreported).
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"public results tree does not exist: {root}")
    run_folders = ([root] if _PUBLIC_RUN_FOLDER_RE.match(root.name) else
                   sorted(d for d in root.iterdir()
                          if d.is_dir() and _PUBLIC_RUN_FOLDER_RE.match(d.name)))
    stray = [c for c in find_cell_dirs(root)
             if not any(folder in c.parents for folder in run_folders)]
    if stray:
        raise ValueError(f"AIPerf cells outside every <engine>-deepep-dropin-<YYYYMMDD> folder "
                         f"under {root}: {', '.join(map(str, stray))}")
    frames = []
    for folder in run_folders:
        if not find_cell_dirs(folder):
            continue
        match = _PUBLIC_RUN_FOLDER_RE.match(folder.name)
        date = match["date"]
        frame = read_exports(folder)
        frame.insert(0, "run_folder", folder.name)
        frame.insert(1, "engine", match["engine"])
        frame.insert(2, "date", f"{date[:4]}-{date[4:6]}-{date[6:]}")
        frames.append(frame)
    if not frames:
        raise ValueError(f"no <engine>-deepep-dropin-<YYYYMMDD> folder with AIPerf artifacts "
                         f"under {root}")
    return pd.concat(frames, ignore_index=True)


def _refuse_duplicate_cells(rows: list[dict[str, Any]]) -> None:
    seen: dict[tuple, str] = {}
    for row in rows:
        key = (row["arm"], row["concurrency"], row["repeat"])
        if key in seen:
            raise ValueError(
                f"two AIPerf cells claim arm={key[0]!r} concurrency={key[1]} repeat={key[2]}: "
                f"{seen[key]} and {row['source']}; put repeats under repeat_<n>/ folders or "
                f"read the arms separately with arm=...")
        seen[key] = row["source"]


# ----------------------------------------------------------------------------------------------
# Gates
# ----------------------------------------------------------------------------------------------

def _known(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value)) \
        and value is not pd.NA


def _value(value: Any) -> Any:
    """JSON-friendly observed/expected value (numpy/pandas scalars -> Python, NA -> None)."""
    if not _known(value):
        return None
    return value.item() if hasattr(value, "item") else value


def _gate(name: str, status: str, observed: Any, expected: Any, reason: str,
          evidence: list[str]) -> dict[str, Any]:
    return {"gate": name, "status": status, "observed": _value(observed),
            "expected": _value(expected), "reason": reason, "evidence": evidence}


def _cell_label(row: pd.Series) -> str:
    return f"aiperf {row['arm']} c{_value(row['concurrency'])} repeat {_value(row['repeat'])}"


def _gate_export(row: pd.Series, evidence: list[str]) -> dict[str, Any]:
    if bool(row["has_export"]):
        return _gate(f"{_cell_label(row)}: summary export written", "PASS", True, True,
                     f"{EXPORT_NAME} present", evidence)
    return _gate(f"{_cell_label(row)}: summary export written", "FAIL", False, True,
                 f"no {EXPORT_NAME}: AIPerf writes none when every request failed; counts "
                 f"below come from {row['errors_from'] or 'no source'}", evidence)


def _gate_errors(row: pd.Series, evidence: list[str]) -> dict[str, Any]:
    name = f"{_cell_label(row)}: zero request errors"
    if not _known(row["errors"]):
        return _gate(name, "SKIP", None, 0, "no error count in export, manifest or log", evidence)
    errors = int(row["errors"])
    details = f" ({row['error_details']})" if row["error_details"] else ""
    status = "PASS" if errors == 0 else "FAIL"
    return _gate(name, status, errors, 0, f"{errors} errored requests [{row['errors_from']}]"
                 f"{details}", evidence)


def _gate_completed(row: pd.Series, evidence: list[str]) -> dict[str, Any]:
    name = f"{_cell_label(row)}: completed == requested"
    requested, completed = row["requests_requested"], row["requests_completed"]
    if not _known(requested):
        return _gate(name, "SKIP", _value(completed), None,
                     "requested count unknown: no profiling phase in input_config, "
                     "run_config.json or the log", evidence)
    if not _known(completed):
        return _gate(name, "FAIL", None, requested, "no completed-request count found", evidence)
    status = "PASS" if int(completed) == int(requested) else "FAIL"
    return _gate(name, status, completed, requested,
                 f"{completed} of {requested} requests completed without error", evidence)


def _gate_cancelled(row: pd.Series, evidence: list[str]) -> dict[str, Any]:
    name = f"{_cell_label(row)}: not cancelled"
    was_cancelled, cancelled = row["was_cancelled"], row["cancelled"]
    if not _known(was_cancelled) and not _known(cancelled):
        return _gate(name, "SKIP", None, 0, "neither was_cancelled nor a cancelled count found",
                     evidence)
    failed = (_known(was_cancelled) and bool(was_cancelled)) or \
        (_known(cancelled) and int(cancelled) > 0)
    observed = {"was_cancelled": _value(was_cancelled), "cancelled_requests": _value(cancelled)}
    return _gate(name, "FAIL" if failed else "PASS", observed,
                 {"was_cancelled": False, "cancelled_requests": 0},
                 "run or requests cancelled" if failed else "nothing cancelled", evidence)


def _gate_output_length(row: pd.Series, evidence: list[str]) -> dict[str, Any]:
    # Informational: a length mismatch does not invalidate throughput, but readers must know.
    name = f"{_cell_label(row)}: output length as requested (informational)"
    mismatches = row["osl_mismatch_count"]
    if not _known(mismatches):
        return _gate(name, "SKIP", None, 0, "osl_mismatch_count not recorded", evidence)
    mismatches = int(mismatches)
    note = ("all requests returned the requested output length" if mismatches == 0 else
            f"note: {mismatches} requests returned a different output length than requested "
            f"(mean output {row['output_tokens_mean']:.1f} tokens); informational, not a failure")
    return _gate(name, "PASS", mismatches, 0, note, evidence)


def gate_cells(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Per-cell gates {gate, status PASS|FAIL|SKIP, observed, expected, reason, evidence}."""
    missing = [c for c in ("arm", "concurrency", "repeat", "errors", "source") if c not in df]
    if missing:
        raise ValueError(f"gate_cells needs a read_exports table; missing columns {missing}")
    gates: list[dict[str, Any]] = []
    for _, row in df.iterrows():
        evidence = [row["source"], *[p for p in str(row.get("evidence") or "").split(";") if p]]
        for check in (_gate_export, _gate_errors, _gate_completed, _gate_cancelled,
                      _gate_output_length):
            gates.append(check(row, evidence))
    return gates


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------

def _print_summary(frame: pd.DataFrame, out=sys.stdout) -> None:
    with pd.option_context("display.width", 250, "display.max_columns", None,
                           "display.float_format", "{:.2f}".format):
        print(frame[list(_DISPLAY_COLUMNS)].to_string(), file=out)
    print("\nsources:", file=out)
    for index, source in frame["source"].items():
        print(f"  [{index}] {source}", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lib.measure.aiperf",
                                     description="Summarize AIPerf artifact directories.")
    commands = parser.add_subparsers(dest="command", required=True)
    summarize = commands.add_parser("summarize", help="print one row per cell and repeat")
    summarize.add_argument("dirs", nargs="+", metavar="DIR", help="AIPerf artifact directory")
    summarize.add_argument("--csv", metavar="FILE", help="also write the table as CSV")
    summarize.add_argument("--arm", help="arm name for every cell (default: from folder names)")
    summarize.add_argument("--gates", action="store_true", help="also print the per-cell gates")
    args = parser.parse_args(argv)

    missing = [d for d in args.dirs if not Path(d).exists()]
    if missing:
        print(f"error: no such AIPerf artifact directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        frame = read_exports(*args.dirs, arm=args.arm)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _print_summary(frame)
    if args.gates:
        print("\ngates:")
        for gate in gate_cells(frame):
            print(f"  {gate['status']:4}  {gate['gate']}: {gate['reason']}")
    if args.csv:
        frame.to_csv(args.csv, index=False)
        print(f"\nwrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
