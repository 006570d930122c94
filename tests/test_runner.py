"""The runner's decisions: which stages a FAIL blocks, and when a resume is refused."""
from lib import places, runner
from lib.core import evidence
from lib.stages import registry


def record(run_dir, stage, *statuses):
    gates = [{"gate": f"g{i}", "status": s, "observed": None, "expected": None,
              "reason": "r", "evidence": []} for i, s in enumerate(statuses)]
    evidence.write_json_new(run_dir / stage / "gates.json", gates)


def test_a_fail_blocks_only_the_stages_that_read_it(tmp_path):
    """The registry says what each stage reads: 06 on the torch benchmark (engine
    transformers, this machine's pick) reads 03; 06 serving with vLLM reads 04, never 03."""
    record(tmp_path, "00_cluster", "PASS")
    record(tmp_path, "04_serve", "PASS", "FAIL")
    assert runner.blocked_by("05_sweep", tmp_path) == ["04_serve"]
    assert runner.blocked_by("06_multicomm", tmp_path) == []
    assert runner.blocked_by("06_multicomm", tmp_path, given={"engine": "vllm"}) == ["04_serve"]
    record(tmp_path, "03_kernel_test", "FAIL")
    assert runner.blocked_by("06_multicomm", tmp_path) == ["03_kernel_test"]
    assert runner.blocked_by("06_multicomm", tmp_path, given={"engine": "vllm"}) == ["04_serve"]
    # the engine 04 recorded in the run decides when none is given
    evidence.write_json_new(tmp_path / "04_serve" / "params.json", {"engine": "vllm"})
    assert runner.blocked_by("06_multicomm", tmp_path) == ["04_serve"]
    # a cluster place serves with vLLM: 06 there reads 04
    assert registry.upstream("06_multicomm", places.engine_default({"context": "kube"})) == (
        "00_cluster", "04_serve")


def test_a_skip_blocks_nothing(tmp_path):
    record(tmp_path, "00_cluster", "SKIP", "PASS")
    assert all(runner.blocked_by(s, tmp_path) == [] for s in registry.STAGES)


def test_resume_is_refused_when_a_recorded_stage_changed(tmp_path):
    record(tmp_path, "00_cluster", "PASS")
    (tmp_path / "run.json").write_text("{}\n")
    evidence.seal(tmp_path)
    assert runner.changed_since_sealed(tmp_path, "00_cluster") == []
    (tmp_path / "00_cluster" / "gates.json").write_text("[]\n")
    assert runner.changed_since_sealed(tmp_path, "00_cluster") == ["00_cluster/gates.json: changed"]


def test_papermill_gets_both_paths_and_the_parameters(tmp_path):
    argv = runner.papermill_argv("04_serve", tmp_path, {"context": "local", "run_id": "x"})
    i = argv.index("papermill")
    assert argv[i + 1].endswith("notebooks/04_serve.ipynb")
    assert argv[i + 2] == str(tmp_path / "notebooks" / "04_serve.ipynb")
    assert argv[-6:] == ["-p", "context", "local", "-p", "run_id", "x"]


def _refused(monkeypatch, tmp_path, capsys, argv):
    """`python -m lib.runner ...` on bad input: exit 2, the parameter named, nothing written."""
    results = tmp_path / "results"
    monkeypatch.setattr(runner, "RESULTS", results)
    monkeypatch.setattr(runner, "run_guide", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("run_guide reached")))
    assert runner.main(argv) == 2
    assert not results.exists()
    return capsys.readouterr().err


def test_a_run_id_that_is_a_path_is_refused_before_any_effect(monkeypatch, tmp_path, capsys):
    outside = tmp_path / "outside"
    err = _refused(monkeypatch, tmp_path, capsys, ["run", "--run-id", str(outside)])
    assert "'run_id'" in err and "letters, digits" in err
    assert not outside.exists()
    err = _refused(monkeypatch, tmp_path, capsys, ["run", "--run-id", "a/../b"])
    assert "'run_id'" in err
    err = _refused(monkeypatch, tmp_path, capsys, ["book", "../x"])
    assert "'run_id'" in err


def test_unknown_context_stage_or_parameter_is_refused(monkeypatch, tmp_path, capsys):
    err = _refused(monkeypatch, tmp_path, capsys, ["run", "--context", "cloud"])
    assert "'context'" in err and "local, plan, kube, slurm" in err
    err = _refused(monkeypatch, tmp_path, capsys, ["run", "--stages", "00_cluster,07_extra"])
    assert "'stages'" in err and "06_multicomm" in err
    err = _refused(monkeypatch, tmp_path, capsys,
                   ["run", "--stages", "00_cluster", "-p", "ab_backends", "deepep_v2"])
    assert "'ab_backends'" in err and "(00_cluster)" in err  # a 05 parameter, 05 not asked
    err = _refused(monkeypatch, tmp_path, capsys, ["run", "-p", "concurency", "4"])
    assert "'concurency'" in err and "concurrency" in err


def test_a_value_its_rule_refuses_stops_before_the_run(monkeypatch, tmp_path, capsys):
    err = _refused(monkeypatch, tmp_path, capsys, ["run", "-p", "concurrency", "0"])
    assert "'concurrency'" in err and "integers >= 1" in err
    err = _refused(monkeypatch, tmp_path, capsys, ["run", "-p", "all2all_backend", "naive"])
    assert "'all2all_backend'" in err and "deepep_v2" in err


def test_a_good_request_reaches_the_run(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(runner, "run_guide", lambda context, run_id, extra, stages: (
        seen.update(context=context, run_id=run_id, extra=extra, stages=stages)
        or (tmp_path / "r", 0)))
    assert runner.main(["run", "--run-id", "gpu-x.1", "--stages", "05_sweep", "--no-book",
                        "-p", "ab_backends", "allgather_reducescatter,deepep_v2"]) == 0
    assert seen == {"context": "local", "run_id": "gpu-x.1", "stages": ["05_sweep"],
                    "extra": {"ab_backends": "allgather_reducescatter,deepep_v2"}}
