"""Files back through a log (lib.places.stream): a real `sh` prints them, the reader gets them
back byte for byte; a cut, damaged or escaping block is refused, naming why."""
import subprocess

import pytest

from lib.places import stream


def folder(tmp_path):
    src = tmp_path / "src"
    (src / "phases").mkdir(parents=True)
    (src / "phases" / "profile_export_aiperf.json").write_text('{"request_count": 3}')
    (src / "logs.txt").write_bytes(b"\x00\x01binary\n")
    return src


def test_a_real_shell_prints_what_the_reader_gets_back(tmp_path):
    src = folder(tmp_path)
    printed = subprocess.run(["sh", "-c", "echo before; " + stream.pack_command(str(src), "c4")
                              + "; echo after"], capture_output=True, text=True, check=True)
    got = stream.unpack(printed.stdout, "c4", tmp_path / "dest")
    assert sorted(p.relative_to(tmp_path / "dest").as_posix() for p in got) == [
        "logs.txt", "phases/profile_export_aiperf.json"]
    assert (tmp_path / "dest" / "logs.txt").read_bytes() == b"\x00\x01binary\n"
    assert stream.unpack(stream.pack(src, "c4"), "c4", tmp_path / "again")  # the same format


def test_a_cut_damaged_or_missing_block_is_refused(tmp_path):
    text = stream.pack(folder(tmp_path), "c4")
    with pytest.raises(stream.StreamError, match="no '=== guide-artifacts begin c8 ===' line"):
        stream.unpack(text, "c8", tmp_path / "d")
    with pytest.raises(stream.StreamError, match="no end line: the log was cut"):
        stream.unpack("\n".join(text.splitlines()[:-1]), "c4", tmp_path / "d")
    lines = text.splitlines()
    lines[1] = ("A" if lines[1][0] != "A" else "B") + lines[1][1:]
    with pytest.raises(stream.StreamError, match="damaged"):
        stream.unpack("\n".join(lines), "c4", tmp_path / "d")


def test_a_path_that_would_leave_the_stage_folder_is_refused(tmp_path):
    import base64, hashlib, io, tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("../escaped")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    data = buffer.getvalue()
    text = "\n".join([stream.BEGIN.format(name="c4"), base64.b64encode(data).decode(),
                      stream.END.format(name="c4", digest=hashlib.sha256(data).hexdigest())])
    with pytest.raises(stream.StreamError, match="would leave"):
        stream.unpack(text, "c4", tmp_path / "d")
    assert not (tmp_path / "escaped").exists()
