"""Files users name on the command line are checked before they are read and before any model
loads: ``/dev/zero``, a FIFO, a directory, a 100 MB file, JSON nested 100,000 deep and
binary data each get one ``error:`` line and exit 2 within seconds (each command reached
through ``smcspec.cli.main`` under an alarm, so a read that blocks or runs away fails the
test instead of hanging it)."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager

import pytest

from smcspec import ConfigError
from smcspec.cli import main
from smcspec.input_files import json_depth, loads_bounded, read_text_file


@contextmanager
def deadline(seconds: int):
    def fail(signum, frame):
        raise TimeoutError(f"not refused within {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def bad_files(tmp_path):
    """Each kind of bad input file, by name."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(100 << 20)  # 100 MB, sparse
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"prompt\0\x01\x02")
    return {
        "/dev/zero": ("/dev/zero", "not a regular file"),
        "fifo": (str(fifo), "not a regular file"),
        "directory": (str(tmp_path), "not a regular file"),
        "100 MB": (str(big), "at most"),
        "100,000 deep": (str(deep), "levels deep"),
        "binary": (str(binary), "binary"),
        "missing": (str(tmp_path / "missing"), "no such file"),
    }


def test_read_text_file_refuses_each_kind_and_reads_text(bad_files, tmp_path):
    ok = tmp_path / "ok.txt"
    ok.write_text("héllo\n", encoding="utf-8")
    assert read_text_file(ok, "x") == "héllo\n"
    for name, (path, message) in bad_files.items():
        if name == "100,000 deep":
            with pytest.raises(ConfigError, match=message):
                loads_bounded(read_text_file(path, "x"), "x")
            continue
        with deadline(10), pytest.raises(ConfigError, match=message):
            read_text_file(path, "x", max_bytes=64 << 20)
    (tmp_path / "latin1").write_bytes(b"caf\xe9")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_text_file(tmp_path / "latin1", "x")


def test_json_depth_skips_brackets_inside_strings():
    assert json_depth('[[1, "[[[\\"["], {"a": [2]}]') == 3
    assert json_depth("[]" * 3) == 1 and json_depth("1") == 0
    assert loads_bounded('{"a": [1]}', "x") == {"a": [1]}
    with pytest.raises(ConfigError, match="not valid JSON"):
        loads_bounded("[1,", "x")


COMMANDS = {
    "generate --calibration": ["generate", "hi", "--method", "ar", "-m", "2", "--calibration"],
    "generate --pair-stats": ["generate", "hi", "--method", "ar", "-m", "2", "--pair-stats"],
    "generate --json-schema": ["generate", "hi", "--method", "ar", "--json-schema"],
    "generate --grammar": ["generate", "hi", "--method", "ar", "--grammar"],
    "generate --tests": ["generate", "def f(): ...", "-N", "2", "-K", "2", "--tests"],
    "serve --calibration": ["serve", "--calibration"],
    "bench --pair-stats": ["bench", "--pair-stats"],
    "eval --data": ["eval", "gsm8k", "--methods", "ar", "--data"],
    "eval --speed-from": ["eval", "gsm8k", "--methods", "ar", "--first", "1", "--speed-from"],
    "distill --data": ["distill", "--out", "{tmp}/o", "--data"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_file_option_refuses_bad_files_before_the_models_load(
    command, bad_files, tmp_path, capsys
):
    # a target that does not exist: were a file accepted, loading would fail with exit 3
    models = [] if command.startswith("distill") else ["--target", str(tmp_path / "no.gguf")]
    for name, (path, message) in bad_files.items():
        if name == "100,000 deep" and command in ("generate --grammar", "generate --tests",
                                                  "distill --data"):  # fmt: skip
            continue  # text files, where a line of brackets is text
        argv = [a.replace("{tmp}", str(tmp_path)) for a in COMMANDS[command]] + [path]
        with deadline(20):
            code = main(argv + models)
        err = capsys.readouterr().err
        assert code == 2, (name, err)
        lines = [line for line in err.splitlines() if line.strip()]
        assert lines[-1].startswith("error: ") and message in lines[-1], (name, err)
