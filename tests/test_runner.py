"""The runner's decisions: which stages a FAIL blocks, and when a resume is refused."""
from lib import evidence, runner


def record(run_dir, stage, *statuses):
    gates = [{"gate": f"g{i}", "status": s, "observed": None, "expected": None,
              "reason": "r", "evidence": []} for i, s in enumerate(statuses)]
    evidence.write_json_new(run_dir / stage / "gates.json", gates)


def test_a_fail_blocks_only_the_stages_that_depend_on_it(tmp_path):
    record(tmp_path, "00_cluster", "PASS")
    record(tmp_path, "04_serve", "PASS", "FAIL")
    assert runner.blocked_by("05_sweep", tmp_path) == ["04_serve"]
    assert runner.blocked_by("06_multicomm", tmp_path) == []
    record(tmp_path, "03_kernel_test", "FAIL")
    assert runner.blocked_by("06_multicomm", tmp_path) == ["03_kernel_test"]


def test_a_skip_blocks_nothing(tmp_path):
    record(tmp_path, "00_cluster", "SKIP", "PASS")
    assert all(runner.blocked_by(s, tmp_path) == [] for s in runner.DEPENDS)


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
