"""AIPerf against a served model: the argv, the cells, the summary table, the plots.

One AIPerf invocation per cell (concurrency C, repeat r), interleaved by repeat (r1: c1, c2, c4;
r2: c1, c2, c4; ...) so a drift of the machine spreads over every level instead of biasing one.
Each cell writes its artifacts to ``<stage>/aiperf/repeat_<r>/aiperf-<engine>-c<C>/``, the layout
``lib.measure.aiperf`` reads (arm from ``aiperf-<arm>-c<C>``, repeat from ``repeat_<r>``). After each
cell the server's resident memory is read from /proc through the door.

``aiperf_argv`` is the only place AIPerf's flags are decided. The summary table is
``lib.measure.aiperf.read_exports``' schema, with paths made relative to the run directory; the gates per
cell are ``lib.measure.aiperf.gate_cells`` plus AIPerf's exit code.
"""
from __future__ import annotations

import gzip
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from lib.measure import aiperf as aiperf_export
from lib.core import evidence
from lib.engines import vllm_logs
from lib.core.door import REPO_ROOT
from lib.core.evidence import Gate, gate, skip
from lib.engines.server import Server, server_rss
from lib.engines.transformers import pinned

AIPERF = REPO_ROOT / ".venv-aiperf" / "bin" / "aiperf"
RSS_LIMIT_BYTES = int(1.5 * 1024 ** 3)  # 1.5 GiB
CELL_BASE_TIMEOUT_S = 180.0  # AIPerf's own start-up is ~6 s on 2 cores; generous for a busy host
PER_REQUEST_TIMEOUT_S = 3.0  # per request per 16 output tokens, before dividing by concurrency
KILL_AFTER_S = 15  # coreutils timeout: KILL this long after TERM
TIMEOUT_CODES = (124, 137)  # timeout's codes: TERM worked / KILL was needed
REQUEST_TIMEOUT_S = 120  # AIPerf's per-request HTTP timeout: a stuck request fails, not hangs
# AIPerf's synthetic prompt text (its --prompt-corpus, aiperf/common/enums/enums.py PromptCorpus in
# the pinned 0.13.0): its default, Shakespeare, is what the image's 0.10.0 always reads (it has no
# such flag), so the argv names a corpus only when it is another. `random` draws tokens from the
# tokenizer's vocabulary (vLLM bench's RandomDataset) and skips tokenizing the 5 MB corpus: 2.4 s
# of every cell's start-up with the guide's seeded tokenizer (AIPerf's "Dataset configured in",
# 2.38 s against 0.28 s, measured here 2026-12-07)
PROMPT_CORPORA = ("sonnet", "coding", "random")
DEFAULT_PROMPT_CORPUS = "sonnet"
DEAD_HUB = "http://127.0.0.1:9"  # any Hugging Face Hub call fails fast (no HF_HUB_OFFLINE here)
MMAP_FOLDER = "aiperf-mmap"
# SGLang 0.5.19 takes it on both routes (entrypoints/openai/protocol.py:370, 902); TensorRT-LLM's
# OpenAI server is not read here (its wheels are not reachable): it gets the same field, unproven
ENGINES_WITH_IGNORE_EOS = ("vllm", "sglang", "trtllm")
# AIPerf treats a local tokenizer path as a hub id when either variable is set, to any value;
# a notebook kernel may carry them from the serving side, and the door's env can only add keys.
UNSET_OFFLINE = ["env", "-u", "HF_HUB_OFFLINE", "-u", "TRANSFORMERS_OFFLINE"]
# A hub id at a pinned commit is read from the engine's cache alone: asking the dead hub first
# cost 48 s of retries per tokenizer load (measured here: AutoTokenizer.from_pretrained of the
# pinned model, HF_ENDPOINT dead, 48.2 s; with HF_HUB_OFFLINE=1, 1.6 s)
CACHE_ONLY = ["env", "-u", "TRANSFORMERS_OFFLINE", "HF_HUB_OFFLINE=1"]


# ---- argv and env --------------------------------------------------------------------------------
def forced_length_inputs(engine: str, output_tokens: int) -> str:
    """The request field that forces the output length, per engine.

    transformers serve rejects ignore_eos / min_tokens (HTTP 422) and takes a generation_config
    JSON string instead; vLLM takes ignore_eos."""
    if engine in ENGINES_WITH_IGNORE_EOS:
        return json.dumps({"ignore_eos": True})
    return json.dumps({"generation_config": json.dumps({"min_new_tokens": int(output_tokens)})})


def aiperf_argv(*, engine: str, model_dir: str | Path, url: str, concurrency: int,
                request_count: int, warmup_requests: int, input_tokens: int, output_tokens: int,
                seed: int, artifact_dir: str | Path, cores: str | None = None,
                aiperf: str | Path = AIPERF, tokenizer_revision: str | None = None,
                prompt_corpus: str = DEFAULT_PROMPT_CORPUS) -> list[str]:
    """The one builder of AIPerf's command line. `tokenizer_revision`: the hub commit of a
    served hub model, its tokenizer then read from the cache the engine downloaded it into (a
    commit leaves no refs/main there, and the hub itself is never reached: DEAD_HUB)."""
    warmup = ["--warmup-request-count", str(warmup_requests)] if warmup_requests else []
    corpus = ([] if prompt_corpus == DEFAULT_PROMPT_CORPUS
              else ["--prompt-corpus", prompt_corpus])
    revision = ["--tokenizer-revision", tokenizer_revision] if tokenizer_revision else []
    argv = [
        *(CACHE_ONLY if tokenizer_revision else UNSET_OFFLINE), str(aiperf), "profile",
        "--model", str(model_dir), "--tokenizer", str(model_dir), *revision,
        "--url", url, "--endpoint-type", "chat", "--streaming",
        "--concurrency", str(concurrency), "--request-count", str(request_count), *warmup,
        "--synthetic-input-tokens-mean", str(input_tokens), *corpus,
        "--output-tokens-mean", str(output_tokens),
        "--extra-inputs", forced_length_inputs(engine, output_tokens),
        "--use-server-token-count", "--no-server-metrics", "--no-gpu-telemetry",
        "--request-timeout-seconds", str(REQUEST_TIMEOUT_S),
        "--random-seed", str(seed), "--ui-type", "none",
        "--artifact-dir", str(artifact_dir),
    ]
    return pinned(argv, cores)


def aiperf_env(mmap_dir: str | Path) -> dict[str, str]:
    """HF_ENDPOINT to a dead port, never HF_HUB_OFFLINE (AIPerf then takes the local tokenizer
    path for a hub id: even HF_HUB_OFFLINE=0 does that, so aiperf_argv unsets both offline
    variables with `env -u`); mmap datasets inside the stage folder, removed after the sweep."""
    return {"HF_ENDPOINT": DEAD_HUB, "AIPERF_DATASET_MMAP_BASE_PATH": str(mmap_dir),
            "COLUMNS": "160"}  # rich wraps its console at 80 columns otherwise


@dataclass(frozen=True)
class Shape:
    """A traffic shape: synthetic input tokens (mean) and forced output tokens per request."""
    name: str
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class SweepPlan:
    """What every AIPerf cell of a serving measurement is asked: the concurrency levels and
    repeats, the requests measured and the warmup per cell, the traffic shapes, the seed of
    AIPerf's synthetic prompts. A stage builds it from its parameter model (05's sweep and
    backend A/B, 06's serving A/B: lib.stages.ab.sweep_plan); the loop (lib.measure.serving) and
    run_cell read it, and nothing below the stage looks a parameter up."""
    concurrency: tuple[int, ...]
    repeats: int
    request_count: int
    # each cell measures at least this many requests per concurrency slot (0: request_count;
    # runs recorded before it had none)
    requests_per_slot: int
    warmup_requests: int
    # each cell's warmup at least its concurrency (runs recorded before it: as given)
    warmup_full_batch: bool
    shapes: tuple[Shape, ...]
    seed: int
    prompt_corpus: str = DEFAULT_PROMPT_CORPUS  # AIPerf's synthetic text (PROMPT_CORPORA)

    def warmup(self, concurrency: int) -> int:
        """Warmup requests of one cell: warmup_requests, raised to the cell's concurrency when
        warmup_full_batch. 8 warmup requests cannot form a batch of 32: the first full batch,
        and the kernels built for its shapes, were measured (run gpu-2xh200-deepep-vllm-20261130:
        each server's first c32 cell was its slow one)."""
        warmup = self.warmup_requests
        return max(warmup, concurrency) if self.warmup_full_batch else warmup

    def requests(self, concurrency: int) -> int:
        """Measured requests of one cell: request_count, raised to requests_per_slot x
        concurrency. 48 requests at concurrency 32 are 1.5 waves: on 2x H200 such cells read
        1558, 2794 and 3540 tok/s in three repeats of one arm (run
        gpu-2xh200-deepep-vllm-20261130d); the public review asked for 5x requests per level."""
        return max(self.request_count, self.requests_per_slot * concurrency)

    def requests_said(self) -> str:
        """The measured requests per cell, as a line says them: one number when every level has
        the same, else one per level."""
        counts = [self.requests(c) for c in self.concurrency]
        if len(set(counts)) == 1:
            return str(counts[0])
        return (" / ".join(map(str, counts)) + " (at concurrency "
                + " / ".join(map(str, self.concurrency)) + ")")

    def cells(self) -> list["Cell"]:
        """Every cell, interleaved by repeat (plan_cells)."""
        return plan_cells(list(self.concurrency), self.repeats)


def cell_timeout_s(request_count: int, warmup_requests: int, output_tokens: int,
                   concurrency: int) -> float:
    per_request = PER_REQUEST_TIMEOUT_S * max(1.0, output_tokens / 16)
    return CELL_BASE_TIMEOUT_S + per_request * (request_count + warmup_requests) / concurrency


# ---- cells ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    repeat: int
    concurrency: int

    def label(self, arm: str) -> str:
        return f"aiperf {arm} c{self.concurrency} repeat {self.repeat}"


def plan_cells(concurrency: list[int], repeats: int) -> list[Cell]:
    """Interleaved by repeat: r1 c1, r1 c2, r1 c4, r2 c1, ..."""
    return [Cell(r, c) for r in range(1, repeats + 1) for c in concurrency]


def cell_dir(stage, cell: Cell, arm: str) -> Path:
    return stage.path("aiperf", f"repeat_{cell.repeat}", f"aiperf-{arm}-c{cell.concurrency}")


@dataclass
class CellRun:
    cell: Cell
    rc: int
    timed_out: bool
    duration_s: float
    output_tail: str
    streams: list[str]
    rss_bytes: int | None
    # vLLM: (before, after) of scrape_metrics, each {"file": ..., "generation_tokens": ...}
    metrics: tuple | None = None
    requests: int | None = None  # measured requests asked of AIPerf (SweepPlan.requests)


_BOX = str.maketrans({c: " " for c in "│╭╮╰╯─┃━┏┓┗┛"})


def _tail(text: str, lines: int = 6) -> str:
    """What AIPerf said last: its exit-error box unwrapped into one line, else the last lines."""
    text = evidence.without_terminal_codes(text.replace("\r", "\n"))
    box = text.rfind("Exit Errors")
    if box >= 0:
        return " ".join(text[box:].translate(_BOX).split())
    kept = [line.rstrip() for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def run_cell(stage, server: Server, cell: Cell, plan: SweepPlan, shape: Shape, *, engine: str,
             mmap_dir: Path, arm: str | None = None) -> CellRun:
    """One AIPerf run of `plan`'s cell at `shape`; its artifacts under the arm's name (default:
    the engine's) in the stage's folder."""
    out = cell_dir(stage, cell, arm or engine)
    input_tokens, output_tokens = shape.input_tokens, shape.output_tokens
    warmup = plan.warmup(cell.concurrency)
    requests = plan.requests(cell.concurrency)

    def argv_for(aiperf, artifact_dir, cores):
        return aiperf_argv(
            engine=engine, model_dir=server.model_dir, url=server.url,
            concurrency=cell.concurrency, request_count=requests, warmup_requests=warmup,
            input_tokens=input_tokens, output_tokens=output_tokens, seed=plan.seed,
            artifact_dir=artifact_dir, cores=cores, aiperf=aiperf or AIPERF,
            tokenizer_revision=server.tokenizer_revision, prompt_corpus=plan.prompt_corpus)

    timeout = cell_timeout_s(requests, warmup, output_tokens, cell.concurrency)
    call = server.run_aiperf(stage, lambda a, d, c: bounded(argv_for(a, d, c), timeout),
                             timeout=timeout + KILL_AFTER_S + 30, out=out,
                             name=f"aiperf-{arm or engine}-c{cell.concurrency}-r{cell.repeat}",
                             env=aiperf_env(mmap_dir))
    rss = server_rss(stage.door, server)
    if not stage.replay:
        redact_tree(out, stage.door)
        compress_bulky(out)
    streams = getattr(call, "streams", None) or [f"calls/{stage.name}/{call.seq:04d}.stdout",
                                                  f"calls/{stage.name}/{call.seq:04d}.stderr"]
    timed_out = call.timed_out or call.rc in TIMEOUT_CODES
    return CellRun(cell, call.rc, timed_out, call.duration_s,
                   _tail(call.stdout + "\n" + call.stderr), streams, rss, requests=requests)


def redact_tree(folder: Path, door) -> None:
    """Clean a cell's artifacts now, as Stage.finish would later (secrets masked, identities
    renamed, as the door writes text): the summary is then read from the very bytes the run
    keeps, so a replay (which reads the kept files) computes the same."""
    for path in sorted(folder.rglob("*")) if folder.exists() else []:
        if path.is_file():
            door.clean_file(path)


# AIPerf's per-request records: no reader here uses them (the summary comes from its
# profile_export_aiperf.json), and at 48 requests a cell they are the largest file of a vLLM
# run's cells (6.5 of 32 MB in gpu-2xh200-deepep-vllm-20261130). Kept whole, gzipped.
BULKY_EXPORTS = ("profile_export.jsonl",)


def compress_bulky(folder: Path) -> list[Path]:
    """Gzip a cell's bulky exports in place (after redaction; byte-reproducible: mtime 0)."""
    done = []
    for path in sorted(folder.rglob("*")) if folder.exists() else []:
        if path.is_file() and path.name in BULKY_EXPORTS:
            packed = path.with_name(path.name + ".gz")
            packed.write_bytes(gzip.compress(path.read_bytes(), mtime=0))
            path.unlink()
            done.append(packed)
    return done


def bounded(argv: list[str], seconds: float) -> list[str]:
    """Under coreutils timeout, which signals AIPerf's whole process group (its ~8 services),
    TERM and then KILL, so a stuck cell leaves no process behind."""
    return ["timeout", "-k", str(int(KILL_AFTER_S)), str(int(math.ceil(seconds))), *argv]


def exit_gate(run: CellRun, arm: str) -> Gate:
    reason = (f"AIPerf exited 0 in {run.duration_s:.1f} s" if run.rc == 0 and not run.timed_out
              else f"AIPerf exited {run.rc}{' (timed out)' if run.timed_out else ''} after "
                   f"{run.duration_s:.1f} s; output tail:\n{run.output_tail}")
    return gate(f"{run.cell.label(arm)}: AIPerf exit 0", run.rc == 0 and not run.timed_out,
                run.rc, 0, reason, run.streams)


# ---- the summary table ---------------------------------------------------------------------------
def _relative(stage, text: Any) -> Any:
    if not isinstance(text, str):
        return text
    root = str(Path(stage.run_dir).resolve()) + "/"
    return text.replace(root, "")


def read_cell_row(stage, cell: Cell, arm: str, requested: int) -> pd.DataFrame:
    """One summary row for one cell; a row with unknowns when AIPerf left no artifacts."""
    folder = cell_dir(stage, cell, arm)
    try:
        return aiperf_export.read_exports(folder, arm=arm)
    except (FileNotFoundError, ValueError) as exc:
        row = {c: None for c in aiperf_export.SUMMARY_COLUMNS}
        row.update(arm=arm, concurrency=cell.concurrency, repeat=cell.repeat,
                   requests_requested=requested, has_export=False,
                   errors_from=f"AIPerf artifacts unreadable: {_relative(stage, str(exc))}",
                   source=str(folder.resolve()), evidence="")
        return pd.DataFrame([row])


def summary_table(stage, cells: list[Cell], arm: str,
                  requested: int | Callable[[int], int]) -> pd.DataFrame:
    """The one schema (lib.measure.aiperf.SUMMARY_COLUMNS), a row per cell, paths run-relative.
    `requested`: the measured requests of every cell, or of a cell by its concurrency."""
    frames = [read_cell_row(stage, cell, arm,
                            requested(cell.concurrency) if callable(requested) else requested)
              for cell in cells]
    dtypes = aiperf_export.empty_summary().dtypes.to_dict()
    frame = pd.concat([f.astype(object) for f in frames], ignore_index=True)
    frame = frame.reindex(columns=list(aiperf_export.SUMMARY_COLUMNS))
    for column, dtype in dtypes.items():
        frame[column] = frame[column].astype(dtype)
    for column in ("source", "evidence"):
        frame[column] = frame[column].map(lambda v: _relative(stage, v))
    return frame.sort_values(["concurrency", "repeat"], ignore_index=True)


def records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """JSON-ready rows: pandas NA / NaN -> None, numpy scalars -> Python."""
    out = []
    for row in frame.to_dict(orient="records"):
        clean = {}
        for key, value in row.items():
            if value is pd.NA or value is None or (isinstance(value, float) and math.isnan(value)):
                clean[key] = None
            else:
                clean[key] = value.item() if hasattr(value, "item") else value
        out.append(clean)
    return out


def write_summary(stage, frame: pd.DataFrame) -> list[str]:
    csv = stage.write_text("summary.csv", frame.to_csv(index=False))
    js = stage.write_json("summary.json", records(frame))
    return [csv, js]


def cell_gates(frame: pd.DataFrame) -> list[Gate]:
    return [Gate(**g) for g in aiperf_export.gate_cells(frame)]


def warmup_gate(frame: pd.DataFrame) -> Gate:
    """Every exported number comes from the profiling phase's export (warm-up excluded)."""
    exported = frame[frame["has_export"].fillna(False).astype(bool)]
    profiling = f"phases/profiling/{aiperf_export.EXPORT_NAME}"
    outside = [r["source"] for _, r in exported.iterrows()
               if not str(r["evidence"]).split(";")[0].endswith(profiling)]
    return gate("warmup excluded from every cell", not outside and len(exported) > 0,
                {"cells_with_export": len(exported), "not_from_profiling_phase": outside},
                {"not_from_profiling_phase": []},
                f"numbers read from {profiling} of each cell" if not outside else
                "some cells' numbers do not come from the profiling phase",
                [profiling] if not outside else outside)


def rss_gate(runs: list[CellRun], after_ready: int | None, evidence_paths: list[str],
             device: str = "cpu") -> Gate:
    samples = [r.rss_bytes for r in runs if r.rss_bytes is not None]
    if after_ready is not None:
        samples.append(after_ready)
    if device != "cpu" and not samples:  # a cluster's server: its memory is not read from here
        return skip("server resident memory under 1.5 GiB",
                    f"the target is for the CPU-only local machine; served on {device} nodes, "
                    "whose processes this machine does not read", evidence_paths)
    if device != "cpu" and samples:  # the 1.5 GiB target is the CPU machine's
        return skip("server resident memory under 1.5 GiB",
                    f"the target is for the CPU-only local machine; served on {device}, whose "
                    f"host memory holds the CUDA context: peak {max(samples) / 2 ** 20:.1f} MiB",
                    evidence_paths)
    if not samples:
        return gate("server resident memory under 1.5 GiB", False, None,
                    f"< {RSS_LIMIT_BYTES} bytes", "no VmRSS sample could be read",
                    evidence_paths)
    peak = max(samples)
    return gate("server resident memory under 1.5 GiB", peak < RSS_LIMIT_BYTES,
                {"peak_mib": round(peak / 2 ** 20, 1), "samples": len(samples)},
                {"peak_mib": f"< {RSS_LIMIT_BYTES / 2 ** 20:.0f}"},
                f"peak VmRSS of the server's processes {peak / 2 ** 20:.1f} MiB over "
                f"{len(samples)} samples (after ready and after each cell)", evidence_paths)


def skip_cells(cells: list[Cell], arm: str, reason: str) -> list[Gate]:
    return [skip(f"{cell.label(arm)}: measured", reason) for cell in cells]


# ---- aggregates and plots ------------------------------------------------------------------------
def by_concurrency(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    """Per concurrency: the mean, min and max of a column over its repeats, and how many."""
    values = frame[["concurrency", column]].copy()
    values[column] = pd.to_numeric(values[column], errors="coerce")
    values = values.dropna()
    if values.empty:
        return pd.DataFrame(columns=["concurrency", "mean", "min", "max", "n"])
    grouped = values.groupby("concurrency")[column]
    table = pd.DataFrame({"mean": grouped.mean(), "min": grouped.min(), "max": grouped.max(),
                          "n": grouped.count()}).reset_index()
    table["concurrency"] = table["concurrency"].astype(int)
    return table


def plot_throughput(frame: pd.DataFrame, title: str = ""):
    from matplotlib.figure import Figure  # no pyplot: the notebook's backend is left alone

    fig = Figure(figsize=(6, 4), dpi=100)
    ax = fig.subplots()
    points = frame[["concurrency", "repeat", "output_tps"]].dropna()
    ax.scatter(points["concurrency"].astype(float), points["output_tps"].astype(float),
               s=18, alpha=0.6, color="tab:blue", label="each repeat")
    agg = by_concurrency(frame, "output_tps")
    if not agg.empty:
        ax.errorbar(agg["concurrency"], agg["mean"],
                    yerr=[agg["mean"] - agg["min"], agg["max"] - agg["mean"]],
                    marker="o", color="tab:blue", capsize=4, label="mean (bars: min-max)")
    _concurrency_axis(ax, frame)
    ax.set_ylabel("output tokens / s")
    ax.set_title(title or "Output throughput against concurrency")
    ax.grid(alpha=0.3)
    _legend_or_note(ax)
    fig.tight_layout()
    return fig


def plot_latency(frame: pd.DataFrame, title: str = ""):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), dpi=100)
    axes = fig.subplots(1, 2)
    for ax, (metric, label) in zip(axes, (("ttft", "time to first token"),
                                          ("itl", "inter-token latency"))):
        for stat, style in (("p50", "-o"), ("p99", "--s")):
            agg = by_concurrency(frame, f"{metric}_{stat}_ms")
            if agg.empty:
                continue
            ax.errorbar(agg["concurrency"], agg["mean"],
                        yerr=[agg["mean"] - agg["min"], agg["max"] - agg["mean"]],
                        fmt=style, capsize=4, label=f"{stat} (mean, bars: min-max)")
        _concurrency_axis(ax, frame)
        ax.set_ylabel("ms")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        _legend_or_note(ax)
    fig.suptitle(title or "Latency against concurrency")
    fig.tight_layout()
    return fig


def _legend_or_note(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8)
    else:
        ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", va="center")


def _concurrency_axis(ax, frame: pd.DataFrame) -> None:
    levels = sorted({int(c) for c in frame["concurrency"].dropna()})
    if levels:
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels)
        ax.set_xticklabels([str(c) for c in levels])
        ax.minorticks_off()
    ax.set_xlabel("concurrency")


def save_png(stage, name: str, fig) -> str:
    """A figure as a stage artifact (replay keeps the recorded file: PNG bytes are not compared)."""
    path = stage.path(name)
    if not (stage.replay and path.exists()):
        evidence.write_new(path, figure_png(fig))
    return stage.rel(path)


def figure_png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": None})
    return buffer.getvalue()


# ---- vLLM's own counters around each cell -----------------------------------------------------
GENERATION_TOKENS = "vllm:generation_tokens_total"  # per engine (DP rank) in vLLM 0.24.0
METRICS_TIMEOUT_S = 30.0


def metric_total(text: str, name: str) -> float | None:
    """Sum of every sample of counter `name` in Prometheus text (all label sets, e.g. one per DP
    engine); None when the metric is absent."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric = head.split("{", 1)[0].strip()
        if metric != name:
            continue
        try:
            total += float(value)
            seen = True
        except ValueError:
            continue
    return total if seen else None


def scrape_metrics(stage, server: Server, cell: Cell, when: str) -> dict:
    """GET /metrics through the door, kept as metrics/repeat_<r>/c<C>.<when>.prom."""
    answer = server.request(stage.door, "GET", "/metrics", timeout=METRICS_TIMEOUT_S)
    name = f"metrics/repeat_{cell.repeat}/c{cell.concurrency}.{when}.prom"
    saved = stage.write_text(name, answer.body or "") if answer.status == 200 else None
    return {"file": saved, "status": answer.status,
            "generation_tokens": metric_total(answer.body or "", GENERATION_TOKENS)
            if answer.status == 200 else None}


# ---- a server's life through its cells -----------------------------------------------------------
EXIT_WAIT_S = 10  # after a cell whose /metrics failed: how long a dying server has to exit


@dataclass
class ServerLife:
    """What the cells of one server saw of it. vLLM 0.24.0 can pass every startup gate and die
    on the first batched step of real traffic (graphs+EP on deepep_v2, 2x H200: run
    gpu-2xh200-deepep-vllm-20261130d); its API server then exits by itself, and every later cell
    would fail against a closed port. A server alive through its cells needs no gate of its
    own: each cell's `vLLM counted the generated tokens` read its /metrics after the cell."""
    label: str  # the arm, and which start: as its gates say it
    exit_code: int | None = None
    died_during: str | None = None
    fatal_line: str | None = None
    step: dict | None = None  # vllm_logs.crashed_step: the step its engine core dumped

    def watch(self, stage, server, cell: str, after: dict) -> None:
        """After a cell whose closing /metrics did not answer: whether the server is gone (it
        has EXIT_WAIT_S seconds to finish exiting), and why (the first fatal line of its log, and
        the step its engine core was running).
        A server that answered costs no call: recordings from before this check replay."""
        if after["status"] == 200:
            return
        proc = getattr(server, "step", None) or server.proc  # a cluster's server: its step
        if proc is None:  # nothing of it runs here to ask (a kube serve: its pods' logs say)
            return
        for _ in range(EXIT_WAIT_S):
            code = stage.door.poll(proc)
            if code is not None:
                self.exit_code, self.died_during = code, cell
                log = stage.door.read_text(server.log_path) or ""
                self.fatal_line = vllm_logs.first_fatal_line(
                    log, log_name=stage.rel(server.log_path))
                self.step = vllm_logs.crashed_step(log, log_name=stage.rel(server.log_path))
                return
            stage.door.sleep(1.0)

    def not_run(self) -> str:
        """The reason of a cell's SKIP once this server is gone."""
        return (f"not run: {self.label}'s server exited (code {self.exit_code}) during "
                f"{self.died_during}")

    def exit_gate(self, stage, server):
        """The FAIL of a server that exited by itself during its cells; None while it lived."""
        if self.exit_code is None:
            return None
        return gate(f"{self.label}: server up through its cells", False,
                    {"exit_code": self.exit_code, "died_during": self.died_during},
                    "up until stopped",
                    f"vLLM exited {self.exit_code} by itself during {self.died_during}; "
                    + (f"the first fatal line of its log: {self.fatal_line}" if self.fatal_line
                       else "its log names no fatal error")
                    + (f"; {vllm_logs.describe_step(self.step)}" if self.step else ""),
                    [self.fatal_line or stage.rel(server.log_path)]
                    + ([self.step["quote"]] if self.step else []))


def token_count_gates(runs: list[CellRun], request_count: int, output_tokens: int,
                      arm: str) -> list[Gate]:
    """Per cell: vLLM's generation_tokens_total grew by at least the cell's measured requests
    (request_count for a run that does not say) x output_tokens (warmup requests add more;
    ignore_eos makes every request generate exactly output_tokens). The server's own count,
    independent of AIPerf's parsing of the stream."""
    gates = []
    for r in runs:
        requested = request_count if r.requests is None else r.requests
        name = f"{r.cell.label(arm)}: vLLM counted the generated tokens"
        before, after = r.metrics or (None, None)
        if not before or not after or before["generation_tokens"] is None \
                or after["generation_tokens"] is None:
            gates.append(gate(name, False, None, GENERATION_TOKENS,
                              f"/metrics could not be read around the cell (HTTP "
                              f"{(before or {}).get('status')} / {(after or {}).get('status')})",
                              []))
            continue
        grew = after["generation_tokens"] - before["generation_tokens"]
        want = requested * output_tokens
        gates.append(gate(name, grew >= want, int(grew), f">= {want}",
                          f"{GENERATION_TOKENS} summed over the DP engines grew by {grew:.0f} "
                          f"({requested} measured requests x {output_tokens} tokens = {want}, "
                          "plus warmup)", [before["file"], after["file"]]))
    return gates
