"""Load held, every error counted: the real local server under more than the sweep's load, with
some requests made to fail on purpose, must stay up, and every failure must be in the evidence.

Real parts only: `transformers serve` with the seeded tiny MoE on 127.0.0.1 (lib.engines.
transformers.local_server), AIPerf 0.13 from .venv-aiperf through the sweep's own argv builder
(lib.measure.sweep.aiperf_argv) and the door, the reader lib.measure.aiperf.read_exports.

What is derived from what:
- concurrency: 1.5 x the highest level of the local context's default sweep (the parameter table,
  engine transformers), rounded up;
- requests: what a sweep cell at that concurrency measures (SweepPlan.requests: at least
  requests_per_slot per slot);
- input tokens and the short answers: the sweep's input_tokens and output_tokens; the long answers
  LONG_FACTOR times longer, half the requests each (AIPerf's --seq-dist);
- the request timeout (AIPerf's --request-timeout-seconds): measured, not guessed. One long answer
  alone, on the idle server, takes t_long; under the load it cannot take less, so a timeout of
  t_long / 2 fails every long one while short answers (t_long / LONG_FACTOR alone) finish within it.

Bounded: a capped request count, every request capped by the timeout, AIPerf under coreutils
timeout, the server stopped by the context manager whatever happens; loopback only.
"""
from __future__ import annotations

import json
import math
import time

import pandas as pd

from lib.core.door import Door
from lib.core.stage import Stage
from lib.engines import models
from lib.engines import transformers as serve
from lib.engines import server as served
from lib.measure import aiperf as aiperf_export
from lib.measure import sweep
from lib.stages import ab, registry as params

STAGE = "05_sweep"
LOAD_FACTOR = 1.5  # the load asked of the server: 1.5 x the sweep's highest concurrency
LONG_FACTOR = 32  # a long answer is this many times a short one: far past any timeout between
TIMEOUT_SHARE = 0.5  # the timeout: this share of one long answer's time on the idle server


def flag_value(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with `flag`'s value replaced (the flag must be there exactly once)."""
    assert argv.count(flag) == 1, flag
    at = argv.index(flag)
    return [*argv[:at + 1], value, *argv[at + 2:]]


def without_flag(argv: list[str], flag: str) -> list[str]:
    assert argv.count(flag) == 1, flag
    at = argv.index(flag)
    return [*argv[:at], *argv[at + 2:]]


def forced_chat(stage, server, tokens: int) -> tuple[float, int]:
    """One chat answer of exactly `tokens` tokens (min_new_tokens = max_tokens, the sweep's way of
    forcing a length on transformers serve): (seconds, completion tokens)."""
    body = {"model": server.model_dir, "max_tokens": tokens,
            "messages": [{"role": "user", "content": served.CHAT_PROMPT}],
            **json.loads(sweep.forced_length_inputs("transformers", tokens))}
    answer = server.request(stage.door, "POST", "/v1/chat/completions",
                            timeout=served.CHAT_TIMEOUT_S, json_body=body)
    assert answer.status == 200, (answer.status, answer.error, answer.body[:300])
    return answer.duration_s, json.loads(answer.body)["usage"]["completion_tokens"]


def test_load_holds_and_every_timeout_is_counted(tmp_path):
    started = time.monotonic()
    p = params.resolve(STAGE, {"engine": "transformers"})
    concurrency = math.ceil(LOAD_FACTOR * max(p["concurrency"]))
    sent = ab.sweep_plan(p, p["repeats"]).requests(concurrency)
    short, long_ = p["output_tokens"], p["output_tokens"] * LONG_FACTOR
    model_dir = models.build(p["seed"], layers=p["model_layers"])["model_dir"]
    run_dir = tmp_path / "run"
    stage = Stage(STAGE, p, run_dir, Door(run_dir, STAGE), None)
    out = stage.path("aiperf", f"aiperf-load-c{concurrency}")

    with serve.local_server(stage, model_dir, timeout_s=p["server_timeout_s"]) as server:
        assert server.ready, [g.reason for g in server.gates]
        up_s = time.monotonic() - started

        # ---- measure the timeout: one long answer alone on the idle (warmed) server
        forced_chat(stage, server, short)  # the first answer pays one-off costs
        t_short, got_short = forced_chat(stage, server, short)
        t_long, got_long = forced_chat(stage, server, long_)
        assert (got_short, got_long) == (short, long_)  # the lengths were forced
        timeout_s = round(TIMEOUT_SHARE * t_long, 2)
        print(f"\ncalibration: {short} tokens {t_short:.2f} s, {long_} tokens {t_long:.2f} s "
              f"alone -> --request-timeout-seconds {timeout_s}")

        # ---- the load: the sweep's argv, its lengths swapped for a half-short, half-long mix
        argv = sweep.aiperf_argv(
            engine="transformers", model_dir=server.model_dir, url=server.url,
            concurrency=concurrency, request_count=sent, warmup_requests=0,
            input_tokens=p["input_tokens"], output_tokens=short, seed=p["seed"],
            artifact_dir=out, cores=server.client_cores)
        argv = without_flag(without_flag(argv, "--synthetic-input-tokens-mean"),
                            "--output-tokens-mean")
        argv = flag_value(argv, "--request-timeout-seconds", str(timeout_s))
        half = 100 // 2  # --seq-dist takes percentages
        argv += ["--seq-dist", f"{p['input_tokens']},{short}:{half};"
                               f"{p['input_tokens']},{long_}:{100 - half}"]
        # at most every request taking its whole timeout, one wave of `concurrency` at a time
        bound_s = sweep.CELL_BASE_TIMEOUT_S + math.ceil(sent / concurrency) * timeout_s
        load_started = time.monotonic()
        call = stage.door.run(sweep.bounded(argv, bound_s),
                              timeout=bound_s + 2 * sweep.KILL_AFTER_S,
                              env=sweep.aiperf_env(stage.path(sweep.MMAP_FOLDER)), check=False)
        load_s = time.monotonic() - load_started
        assert call.rc == 0 and not call.timed_out, (call.rc, call.stderr[-2000:])

        # ---- no crash: the same process still answers /health and a chat request
        assert stage.door.poll(server.proc) is None, "the server exited under the load"
        health = server.request(stage.door, "GET", "/health", timeout=served.PROBE_TIMEOUT_S)
        assert (health.status, json.loads(health.body or "{}").get("status")) == (200, "ok"), \
            (health.status, health.body)
        chat, _ = served.chat_gate(stage, server)
        assert chat.status == "PASS", chat.reason
        assert "Traceback" not in server.log_path.read_text(errors="replace"), \
            served.log_tail(stage.door, server.log_path)

    # ---- every request counted: the project's summary row
    frame = aiperf_export.read_exports(out, arm="load")
    assert len(frame) == 1
    row = frame.iloc[0]
    completed, errors = int(row["requests_completed"]), int(row["errors"])
    cancelled = 0 if pd.isna(row["cancelled"]) else int(row["cancelled"])
    assert (int(row["concurrency"]), int(row["requests_requested"])) == (concurrency, sent)
    assert bool(row["has_export"]) and not pd.isna(row["was_cancelled"]) \
        and not bool(row["was_cancelled"])
    assert completed + errors + cancelled == sent, (completed, errors, cancelled, sent,
                                                    row["errors_from"])
    assert 0 < errors < sent, (f"{errors} errors of {sent}: the test needs both sides "
                               f"(timeout {timeout_s} s, long answer alone {t_long:.2f} s)")

    # ---- cross-checked against AIPerf's own per-request records and its error summary
    records = [json.loads(line)
               for line in (out / "profile_export.jsonl").read_text().splitlines() if line]
    assert len(records) == sent
    assert {r["metadata"]["benchmark_phase"] for r in records} == {"profiling"}
    failed = [r for r in records if r.get("error")]
    assert (len(records) - len(failed), len(failed)) == (completed, errors)
    assert {r["error"]["type"] for r in failed} == {"TimeoutError"}  # failed as made to fail
    export = json.loads((out / aiperf_export.EXPORT_NAME).read_text())
    assert sum(e["count"] for e in export["error_summary"]) == errors
    # AIPerf's completed_request_count is successes + errors: the reader must not take it as
    # completed (it did before: 24 completed + 11 errors of 24 sent)
    assert export["completed_request_count"]["avg"] == sent
    assert export["request_count"]["avg"] == completed
    log = aiperf_export.parse_aiperf_log(out / aiperf_export.LOG_RELATIVE_PATH)
    assert (log["requested"], log["returned"], log["errors"], log["cancelled"]) == \
        (sent, sent, errors, cancelled)

    # which answers failed: the requested lengths of the records, from AIPerf's inputs.json
    asked = {s["session_id"]: s["payloads"][0]["max_completion_tokens"]
             for s in json.loads((out / "inputs.json").read_text())["data"]}
    split = {(asked[r["metadata"]["conversation_id"]], bool(r.get("error"))): 0 for r in records}
    for r in records:
        split[(asked[r["metadata"]["conversation_id"]], bool(r.get("error")))] += 1

    # the reader's gates say it too
    gates = {g["gate"].rsplit(": ", 1)[1]: g for g in aiperf_export.gate_cells(frame)}
    assert gates["zero request errors"]["status"] == "FAIL"
    assert gates["zero request errors"]["observed"] == errors
    assert gates["completed == requested"]["status"] == "FAIL"
    assert gates["completed == requested"]["observed"] == completed

    timeouts = sum(1 for r in failed if r["error"]["type"] == "TimeoutError")
    print(f"load: concurrency {concurrency}, sent {sent}, completed {completed}, errors {errors} "
          f"(timeouts {timeouts}), cancelled {cancelled}; by requested length "
          + ", ".join(f"{n} tokens {'timed out' if bad else 'answered'}: {k}"
                      for (n, bad), k in sorted(split.items()))
          + f"; AIPerf {load_s:.1f} s (benchmark {export['benchmark_duration']['avg']:.1f} s); "
          f"server up after {up_s:.1f} s; test {time.monotonic() - started:.1f} s")
