"""``generate``'s steering options on a tiny pair: --tests / --reward examples / arithmetic,
--aggregate vote, --answer-regex, and their one-line errors."""

from __future__ import annotations

import json

import pytest
from tiny_models import make_tiny_hf_model

from smcspec.cli import main


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-steering")
    return [str(make_tiny_hf_model(root, "qwen2", seed=s)) for s in (0, 1)]


def _base(pair, prompt: str = "ab") -> list[str]:
    models = ["--target", pair[0], "--draft", pair[1]]
    setting = ["--method", "smc", "-N", "4", "-K", "2", "-m", "8", "--seed", "3"]
    return ["generate", prompt, *models, "--no-chat", *setting, "--json"]


def test_tests_file_reward_and_vote(pair, tmp_path, capsys) -> None:
    tests = tmp_path / "tests.py"
    tests.write_text("assert ab == 1\n")
    assert main([*_base(pair), "--tests", str(tests), "--aggregate", "vote"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "log_normalizer" in out  # the reward was applied
    assert "vote" not in out or set(out["vote"]) == {"answer", "share", "text", "answers"}


def test_arithmetic_reward_and_vote(pair, capsys) -> None:
    argv = [*_base(pair, "2 + 2 = 5\n"), "--reward", "arithmetic", "--aggregate", "vote"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert "log_normalizer" in out  # the reward was applied


def test_vote_over_a_regex(pair, capsys) -> None:
    argv = [*_base(pair), "--aggregate", "vote", "--answer-regex", "[a-z]", "--particles-out"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["vote"]["answer"] in {p["text"][-1] for p in out["particles"]}
    assert 0 < out["vote"]["share"] <= 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--reward", "examples"], "no examples in the prompt"),
        (["--answer-regex", "x"], "--answer-regex needs --aggregate vote"),
        (["--aggregate", "vote", "--answer-regex", "("], "invalid answer_regex"),
        (["--tests", "/nonexistent/tests.py"], "tests file /nonexistent/tests.py: no such file"),
    ],
)
def test_steering_errors_are_one_line(pair, capsys, extra, message) -> None:
    assert main([*_base(pair), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "\n" not in err


def test_a_vote_needs_smc(pair, capsys) -> None:
    argv = ["generate", "ab", "--target", pair[0], "--method", "ar", "--aggregate", "vote"]
    assert main(argv) == 2
    assert "a vote needs particles" in capsys.readouterr().err
