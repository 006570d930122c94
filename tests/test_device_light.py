"""scripts/device-light.sh on a real git repository made by the test: the GPU runs leave the
index (not the disk, not HEAD) and come back exactly; staged work is never put at risk."""
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device-light.sh"


def git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


def light(repo, *args):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=repo, capture_output=True, text=True)


def make_repo(tmp_path):
    repo = tmp_path / "repo"
    for rel in ("results/gpu-a/x.json", "results/gpu-b/notebooks/y.ipynb", "results/local-c/z",
                "lib/code.py", "results/gpu-a.notes.md"):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(rel * 100)
    git(repo.parent, "init", "-q", str(repo))
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "init")
    (repo / ".git" / "info").mkdir(exist_ok=True)
    (repo / ".git" / "info" / "exclude").write_text("/.whl/\n")
    return repo


def test_on_drops_the_gpu_runs_from_what_travels_and_off_restores_them(tmp_path):
    repo = make_repo(tmp_path)
    before = git(repo, "ls-files")
    on = light(repo, "on")
    assert on.returncode == 0, on.stderr
    tracked = git(repo, "ls-files").split()
    assert not [p for p in tracked if p.startswith("results/gpu-") and "/" in p[len("results/"):]]
    assert "results/local-c/z" in tracked and "lib/code.py" in tracked
    assert "results/gpu-a.notes.md" in tracked  # only run folders are dropped
    assert (repo / "results/gpu-a/x.json").exists()  # the files stay on disk
    assert git(repo, "status", "--porcelain", "--untracked-files=all", "--", "results/gpu-a") \
        .strip().startswith("D ")  # staged deletion, not an untracked file that would travel
    assert "?? results/gpu-a" not in git(repo, "status", "--porcelain", "--untracked-files=all")
    assert light(repo, "status").stdout.strip().endswith("on")
    assert "already on" in light(repo, "on").stdout
    off = light(repo, "off")
    assert off.returncode == 0, off.stderr
    assert git(repo, "ls-files") == before
    assert git(repo, "status", "--porcelain") == ""
    assert (repo / ".git" / "info" / "exclude").read_text() == "/.whl/\n"
    assert "already off" in light(repo, "off").stdout


def test_on_refuses_while_work_is_staged(tmp_path):
    repo = make_repo(tmp_path)
    (repo / "lib" / "code.py").write_text("changed")
    git(repo, "add", "lib/code.py")
    refused = light(repo, "on")
    assert refused.returncode == 2 and "staged changes" in refused.stderr
    assert git(repo, "diff", "--cached", "--name-only").split() == ["lib/code.py"]
    assert light(repo, "status").stdout.strip().endswith("off")
    assert light(repo, "sideways").returncode == 2
