"""make rerecord's new run ids (tests/rerecord.py): an id names one run for good, so a run
taken out of the tree (results/REMOVED) keeps its id from every later run."""
from datetime import datetime, timezone

from tests import rerecord


def test_a_new_id_skips_the_runs_in_the_tree_and_the_removed_ones(tmp_path, monkeypatch):
    day = datetime.now(timezone.utc).strftime("%Y%m%d")
    monkeypatch.setattr(rerecord, "RESULTS", tmp_path)
    monkeypatch.setattr(rerecord, "REMOVED", tmp_path / "REMOVED")
    assert rerecord.new_id("kube-ctlplane") == f"kube-ctlplane-{day}"
    (tmp_path / f"kube-ctlplane-{day}b").mkdir()  # in the tree
    (tmp_path / "REMOVED").write_text(  # taken out, replaced by the b run
        f"kube-ctlplane-{day} {'e' * 40} kube-ctlplane-{day}b\n")
    assert rerecord.removed_ids() == {f"kube-ctlplane-{day}"}
    assert rerecord.new_id("kube-ctlplane") == f"kube-ctlplane-{day}c"
