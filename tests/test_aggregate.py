"""The weighted vote over particles (smcspec.aggregate) and its path through the engine."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import make_tiny_chat_pair

from smcspec import Engine, GenerationConfig
from smcspec.aggregate import Vote, weighted_vote
from smcspec.backends.torch import load_hf_dir
from smcspec.decoding.registry import decoder_for
from smcspec.errors import ConfigError


def test_weighted_vote_is_the_weighted_mode() -> None:
    won = weighted_vote(["7", "8", "7", None, "8"], [0.1, 0.3, 0.15, 0.4, 0.05])
    assert won is not None
    assert (won.answer, won.index, won.answers) == ("8", 1, 2)
    assert won.share == pytest.approx(0.35 / 0.6)
    assert weighted_vote(["a", "b"], [0.5, 0.5]).answer == "a"  # a tie: the first
    assert weighted_vote([None, "x"], [1.0, 0.0]) is None  # no weighted answer
    with pytest.raises(ValueError):
        weighted_vote(["a"], [0.5, 0.5])
    with pytest.raises(ValueError):
        weighted_vote(["a"], [-1.0])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.one_of(st.none(), st.sampled_from("abcd")), st.floats(0, 1)), max_size=12)
)
def test_weighted_vote_matches_brute_force(pairs) -> None:
    answers, weights = [a for a, _ in pairs], [w for _, w in pairs]
    totals: dict[str, float] = {}
    for a, w in pairs:
        if a is not None and w > 0:
            totals[a] = totals.get(a, 0.0) + w
    won = weighted_vote(answers, weights)
    if not totals:
        assert won is None
        return
    best = max(totals.values())
    # ties: the answer whose first particle with weight comes first (zero weight has no say)
    first = next(a for a, w in pairs if a is not None and w > 0 and totals[a] == best)
    assert won is not None and won.answer == first
    assert won.share == pytest.approx(best / sum(totals.values()))
    assert answers[won.index] == first
    assert weights[won.index] == max(w for a, w in pairs if a == first)


def test_regex_answers() -> None:
    num = Vote.regex()
    assert num.answer_fn("so 3 + 4 = 1,234 apples") == "1234"
    assert num.answer_fn("no number") is None
    assert Vote.regex(r"answer: (\w+)").answer_fn("answer: yes ... answer: no") == "no"
    with pytest.raises(ConfigError, match="answer_regex"):
        Vote.regex("(")


def test_a_slow_answer_regex_gives_no_answer_instead_of_stalling() -> None:
    """A pattern whose match runs past its time limit gives no answer (the server runs
    clients' patterns on its decoding worker)."""
    import time

    pattern = r"(?:x+x+)+y|(\d)"  # backtracks catastrophically on runs of x
    vote = Vote.regex(pattern)  # the default limit, 0.25 s a text
    assert vote.answer_fn("x" * 12 + "7") == "7"
    t0 = time.perf_counter()
    assert vote.answer_fn("x" * 200_000 + "7") is None  # measured: over 30 s uncut
    assert time.perf_counter() - t0 < 5
    assert Vote.regex(r"(\d+)x").answer_fn("12x 34x") == "34"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    dirs = make_tiny_chat_pair(tmp_path_factory.mktemp("vote"))
    return Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))


def test_engine_returns_the_weighted_mode_of_its_particles(engine) -> None:
    vote = Vote.regex("[a-d]")  # a particle's answer: its last letter a-d
    contested = 0  # votes between two or more answers (seed 2 has one)
    for seed in range(4):
        cfg = GenerationConfig(
            method="smc", particles=8, max_new_tokens=6, seed=seed, vote=vote,
            return_particles=True,
        )  # fmt: skip
        res = engine.generate("ab", cfg)
        texts = [p["text"] for p in res.particles]
        weights = [p["weight"] for p in res.particles]
        want = weighted_vote([vote.answer_fn(t) for t in texts], weights)
        if want is None:
            assert res.vote is None
            continue
        assert res.vote["answer"] == want.answer and res.vote["share"] == want.share
        contested += want.answers > 1
        assert res.vote["text"] == texts[want.index] and res.to_dict()["vote"] == res.vote
        # the same request without return_particles: the same vote, no particles
        plain = engine.generate(
            "ab", GenerationConfig(**{**cfg.__dict__, "return_particles": False})
        )
        assert plain.particles is None and plain.vote == res.vote and plain.text == res.text
    assert contested >= 1


def test_a_vote_needs_particles() -> None:
    for cfg in (
        GenerationConfig(method="ar", vote=Vote.regex()),
        GenerationConfig(method="smc", temperature=0, vote=Vote.regex()),
        GenerationConfig(method="smc", vote="last number"),
    ):
        with pytest.raises(ConfigError, match="vote"):  # validate, then the table's checks
            decoder_for(cfg.validate())
