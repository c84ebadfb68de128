"""The tuner's calibration prompts (``--calibration FILE``): reading, keys, CLI errors."""

from __future__ import annotations

import json

import pytest

from smcspec import ConfigError
from smcspec.cli import main
from smcspec.tuning.calibration import (
    DEFAULT_TOKENS_PER_PROMPT,
    MAX_PROMPTS,
    MAX_TOKENS_PER_PROMPT,
    Calibration,
    read_calibration,
)
from smcspec.tuning.measure import ACCEPTANCE_PROMPTS


def test_one_prompt_a_line_blank_lines_skipped_json_strings_decoded(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text('  first prompt \n\n"two\\nlines"\n"unclosed\nlast\n', encoding="utf-8")
    cal = read_calibration(f)
    assert cal.prompts == ("first prompt", "two\nlines", '"unclosed', "last")
    assert cal.tokens_per_prompt == DEFAULT_TOKENS_PER_PROMPT and cal.source == f
    assert cal.new_tokens == 4 * DEFAULT_TOKENS_PER_PROMPT


def test_a_json_array_of_strings(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(["a\nb", "c"]), encoding="utf-8")
    assert read_calibration(f, 9).prompts == ("a\nb", "c")


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "no calibration prompt"),
        ("\n  \n", "no calibration prompt"),
        ("[1, 2]", "non-empty string"),
        ('["a", ""]', "non-empty string"),
        ("[oops", "is not valid JSON"),
        ("[" * 100 + "]" * 100, "levels deep"),
        ("x\n" * (MAX_PROMPTS + 1), f"at most {MAX_PROMPTS}"),
    ],
)
def test_bad_files_are_clear_errors(tmp_path, content, message):
    f = tmp_path / "p.txt"
    f.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match=message):
        read_calibration(f)


def test_unreadable_file_and_bad_budget(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        read_calibration(tmp_path / "missing.txt")
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="binary"):
        read_calibration(tmp_path / "bin")
    (tmp_path / "ok").write_text("a\n")
    for bad in (1, 0, -3, True, 2.5, MAX_TOKENS_PER_PROMPT + 1):
        with pytest.raises(ConfigError, match="--calibration-tokens"):
            read_calibration(tmp_path / "ok", bad)


def test_the_builtin_measurement_keeps_the_old_key_others_get_their_own():
    assert Calibration().builtin and Calibration().key == ""
    assert Calibration(ACCEPTANCE_PROMPTS, DEFAULT_TOKENS_PER_PROMPT).key == ""
    a = Calibration(("x", "y"), 64)
    keys = {a.key, Calibration(("x", "y"), 65).key, Calibration(("y", "x"), 64).key}
    assert len(keys) == 3 and all(k.startswith(",calibration=") for k in keys)
    assert Calibration(("x", "y"), 64).key == a.key  # the same prompts: the same cache entry
    assert Calibration(ACCEPTANCE_PROMPTS, 32).key != ""


def test_cli_refuses_bad_calibration_before_loading_models(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    missing = str(tmp_path / "nothing-here.gguf")  # never loaded: the file fails first
    assert main(["bench", "--predict", "--target", missing, "--calibration", str(empty)]) == 2
    assert "no calibration prompt" in capsys.readouterr().err
    assert main(["bench", "--predict", "--target", missing, "--calibration-tokens", "8"]) == 2
    assert "goes with --calibration" in capsys.readouterr().err
