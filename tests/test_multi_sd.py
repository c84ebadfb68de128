"""Multi-draft sd (``sd`` with N >= 2 chains): the tree's verification rule and the decoder.

The rule (:func:`smcspec.sampling.tree_verify.multi_draft_verify`) is checked on its own,
vectorised over many independent trees, where exactness is cheap to test sharply: at one
node the token it yields follows the target exactly (sampled, and enumerated over every
candidate tuple without sampling), and a whole decode of an order-1 Markov "model"
(next-token tables for the target and the draft) run round after round through the rule
follows the target's chain exactly, for several N and K. With one chain the rule is
chain sd's :func:`~smcspec.sampling.speculative.speculative_verify`, draw for draw. The
decoder is checked here for what is cheap (its fused round draws what its steps draw, greedy
requests run as chain sd, bad settings are clear errors); its output distribution on tiny
enumerable transformers is in ``test_multi_sd_statistical.py`` (slow tier).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from enumerable import tiny_transformer
from scipy.stats import chisquare
from tiny_models import make_tiny_chat_pair

import smcspec.decoding.sd.multi_sd as multi_sd
import smcspec.sampling.tree_verify as tree_verify
from smcspec import Engine, GenerationConfig
from smcspec.backends.pool import pool_needs
from smcspec.backends.torch import load_hf_dir
from smcspec.decoding.labels import parse_label
from smcspec.decoding.registry import DECODERS, decoder_for
from smcspec.decoding.sd.multi_sd import decode_multi_sd
from smcspec.errors import ConfigError, ContextLengthError
from smcspec.sampling.speculative import speculative_verify
from smcspec.sampling.tree_verify import multi_draft_verify


def _tables(v: int, seed: int, sharp: float = 1.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Random next-token tables ``[V, V]`` (row: the previous token) for a target and a
    draft that differ (TV between rows about 0.4-0.6)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(v, v, generator=g, dtype=torch.float64) * sharp, -1)
    q = torch.softmax(torch.randn(v, v, generator=g, dtype=torch.float64) * sharp, -1)
    return p, q


def test_one_node_yields_the_target_exactly():
    v, n, b = 6, 4, 200_000
    p, q = _tables(v, seed=0)
    p, q = p[0], q[0]
    g = torch.Generator().manual_seed(1)
    drafted = torch.multinomial(q, b * n, replacement=True, generator=g).view(b, n, 1)
    out = multi_draft_verify(
        drafted,
        None,
        q.expand(b, n, 1, v),
        p.expand(b, n, 2, v),
        torch.rand(b, 1, n, generator=g, dtype=torch.float64),
        torch.rand(b, 1, generator=g, dtype=torch.float64),
    )
    first = torch.where(out.accepted == 1, drafted[torch.arange(b), out.chain, 0], out.token)
    counts = torch.bincount(first, minlength=v).double()
    # chi-square over the 6 tokens at 200k trees: p-value bound 1e-3 (measured 0.50)
    assert chisquare(counts.numpy(), (p * b).numpy()).pvalue > 1e-3
    assert bool(out.valid.all()) and out.tried.max() <= n
    # more chains accept more often: one chain accepts with probability sum min(p, q)
    one = float(torch.minimum(p, q).sum())
    assert float((out.accepted == 1).double().mean()) > one + 0.1


def _markov_decode(p, q, n, k, length, b, seed, verify=multi_draft_verify):
    """``b`` independent streams decoded round after round through ``verify`` from token 0,
    the target and the draft being order-1 chains (``p[prev]``, ``q[prev]``): every row of a
    round's tree starts from the stream's last token, its N chains drawn from ``q``. Returns
    the streams' first ``length`` tokens (int64 ``[b, length]``)."""
    g = torch.Generator().manual_seed(seed)
    v = p.shape[0]
    out = torch.zeros(b, length + k + 1, dtype=torch.long)
    have = torch.zeros(b, dtype=torch.long)
    last = torch.zeros(b, dtype=torch.long)
    rows = torch.arange(b)
    while bool((have < length).any()):
        prev = last[:, None].expand(b, n)
        chains, q_rows, p_rows = [], [], [p[prev]]
        for _ in range(k):
            dist = q[prev]
            u = torch.rand(b, n, 1, generator=g, dtype=torch.float64)
            tok = (u > dist.cumsum(-1)).sum(-1).clamp(max=v - 1)  # inverse-CDF draws
            chains.append(tok)
            q_rows.append(dist)
            prev = tok
            p_rows.append(p[prev])
        drafted = torch.stack(chains, 2)
        verdict = verify(
            drafted,
            None,
            torch.stack(q_rows, 2),
            torch.stack(p_rows, 2),
            torch.rand(b, k, n, generator=g),
            torch.rand(b, 1, generator=g, dtype=torch.float64),
        )
        path = drafted[rows, verdict.chain]  # [b, k]
        for j in range(k + 1):
            take = (j <= verdict.accepted) & (have < length)
            tok = torch.where(j < verdict.accepted, path[:, min(j, k - 1)], verdict.token)
            out[rows[take], have[take]] = tok[take]
            last = torch.where(take, tok, last)
            have = have + take.long()
            if j >= int(verdict.accepted.max()):
                break
    return out[:, :length]


def _sequence_index(seqs: torch.Tensor, v: int) -> torch.Tensor:
    idx = torch.zeros(seqs.shape[0], dtype=torch.long)
    for t in range(seqs.shape[1]):
        idx = idx * v + seqs[:, t]
    return idx


@pytest.mark.parametrize(("n", "k"), [(1, 3), (2, 2), (4, 3), (8, 4)])
def test_markov_decode_follows_the_target_exactly(n, k):
    v, length, b = 3, 4, 30_000
    p, q = _tables(v, seed=2)
    seqs = _markov_decode(p, q, n, k, length, b, seed=10 + n)
    exact = _markov_probs(p, length)
    counts = torch.bincount(_sequence_index(seqs, v), minlength=v**length).double()
    # chi-square over the 81 sequences at 30k streams: p-value bound 1e-3 (measured 0.1-0.9)
    assert chisquare(counts.numpy(), (exact * b).numpy()).pvalue > 1e-3


def _markov_probs(p: torch.Tensor, length: int) -> torch.Tensor:
    """``P(x_1..x_L)`` from token 0 for every sequence, indexed as :func:`_sequence_index`."""
    v = p.shape[0]
    seqs = torch.cartesian_prod(*[torch.arange(v)] * length).view(-1, length)
    prev = torch.zeros(seqs.shape[0], dtype=torch.long)
    out = torch.ones(seqs.shape[0], dtype=torch.float64)
    for t in range(length):
        out = out * p[prev, seqs[:, t]]
        prev = seqs[:, t]
    return out


def test_a_rule_without_the_residual_fails_the_same_test(monkeypatch):
    """Broken variant: rejections leave ``r = p`` (no residual), so a later candidate is tested
    against the target itself: the output over-weights tokens the draft proposes."""
    monkeypatch.setattr(tree_verify, "_residual", lambda r, q: r)
    v, length, b = 3, 4, 30_000
    p, q = _tables(v, seed=2)
    seqs = _markov_decode(p, q, 4, 3, length, b, seed=14)
    counts = torch.bincount(_sequence_index(seqs, v), minlength=v**length).double()
    assert chisquare(counts.numpy(), (_markov_probs(p, length) * b).numpy()).pvalue < 1e-6


def _node_verdicts(drafted: torch.Tensor, p: torch.Tensor, q: torch.Tensor, u_accept, u_next):
    """:func:`multi_draft_verify` on one node (K = 1) for each row of ``drafted`` (``[B, m]``
    candidates), ``p`` and ``q`` its target and draft distributions (``[V]``)."""
    b, m = drafted.shape
    v = p.numel()
    return multi_draft_verify(drafted[:, :, None], None, q.expand(b, m, 1, v),
                              p.expand(b, m, 2, v), u_accept[:, None, :], u_next)  # fmt: skip


def test_one_node_yields_the_target_exactly_by_enumeration():
    """One node's output distribution, enumerated without sampling: every tuple of m = 3
    candidates (i.i.d. from ``q``; 125 tuples) with its probability, run down the accept/reject
    tree (``r_0 = p``; accept ``x_i`` with probability ``min(1, r_{i-1}(x_i) / q(x_i))``; on
    rejection ``r_i`` is the module's own :func:`tree_verify._residual` of ``r_{i-1}``; all
    rejected: a draw from ``r_m``, normalised as the final draw normalises), sums to ``p``
    within 1e-9 (float64; measured 5.6e-17). The pair's residual ``max(p - q, 0)`` covers three
    tokens, so its normalisation matters (on the sampled tests' tables an unnormalised one is
    TV 0.0004 off at their node and exact in the Markov decodes, whose residual is one
    token). :func:`multi_draft_verify` is tied to the same tree: each candidate is accepted
    just below its threshold and, with all of them just above theirs, rejected, and the final
    token is ``r_m``'s inverse-CDF draw. Broken variant caught: the residual left unnormalised
    (``max(r - q, 0)`` without dividing by its mass): the node's output is TV 0.098 from ``p``
    (the sampled test above passes it)."""
    p = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1], dtype=torch.float64)
    q = torch.tensor([0.1, 0.15, 0.15, 0.2, 0.4], dtype=torch.float64)
    m, v = 3, p.numel()
    drafted = torch.cartesian_prod(*[torch.arange(v)] * m)  # [125, m]: every candidate tuple
    b = drafted.shape[0]
    reach = q[drafted].prod(1)  # P(tuple), then P(tuple and the first i rejected)
    r, out = p.expand(b, v), torch.zeros(b, v, dtype=torch.float64)
    accept = torch.zeros(b, m, dtype=torch.float64)  # min(1, r_{i-1}(x_i) / q(x_i))
    for i in range(m):
        x = drafted[:, i : i + 1]
        accept[:, i] = (r.gather(1, x) / q[x]).clamp(max=1.0)[:, 0]
        out.scatter_add_(1, x, (reach * accept[:, i])[:, None])
        reach = reach * (1 - accept[:, i])
        r = tree_verify._residual(r, q.expand(b, v))
    final = r / r.sum(-1, keepdim=True)
    out += reach[:, None] * final
    node = out.sum(0)
    # exact enumeration in float64: 1e-9 (measured 5.6e-17; the unnormalised residual: 0.098)
    tv = float((node - p).abs().sum()) / 2
    assert float((node - p).abs().max()) < 1e-9, f"the node's output is TV {tv:.4f} from p"
    # the rule itself decides at the same thresholds (relative margin 1e-6 each side)
    rejectable = accept < 1 - 1e-6
    above = accept * (1 + 1e-6)  # a uniform that rejects candidate i
    mid = torch.full((b, 1), 0.5, dtype=torch.float64)
    for i in range(m):
        u = torch.where(torch.arange(m) < i, above, torch.zeros_like(above))
        u[:, i] = accept[:, i] * (1 - 1e-6)
        got = _node_verdicts(drafted, p, q, u, mid)
        reached = rejectable[:, :i].all(1) & (accept[:, i] > 1e-9)
        assert bool((got.accepted[reached] == 1).all() and (got.chain[reached] == i).all()), i
    none = rejectable.all(1)  # rows where every candidate can be rejected
    cdf = final.cumsum(-1)
    for t in range(v):  # u_next inside token t's share of r_m
        has = none & (final[:, t] > 1e-6)
        got = _node_verdicts(drafted, p, q, above, (cdf[:, t] - final[:, t] / 2)[:, None])
        assert bool((got.accepted[has] == 0).all() and (got.tried[has, 0] == m).all())
        assert bool((got.token[has] == t).all()), t


def test_one_chain_is_chain_sd_draw_for_draw():
    v, k = 7, 3
    for s in range(100):
        g = torch.Generator().manual_seed(s)
        q = torch.softmax(torch.randn(k, v, generator=g) * 2, -1)
        p = torch.softmax(torch.randn(k + 1, v, generator=g) * 2, -1)
        d = torch.stack([torch.multinomial(q[j], 1, generator=g)[0] for j in range(k)])
        g1, g2 = torch.Generator().manual_seed(100 + s), torch.Generator().manual_seed(100 + s)
        n_chain, tok_chain = speculative_verify(d, q, p, g1)
        u_accept = torch.rand(k, generator=g2).view(1, k, 1)  # speculative_verify's draws
        u_next = torch.rand(1, 1, generator=g2, dtype=torch.float64)
        out = multi_draft_verify(d.view(1, 1, k), None, q[None, None], p[None, None],
                                 u_accept, u_next)  # fmt: skip
        assert (int(out.accepted), int(out.token)) == (n_chain, tok_chain), s


def test_chains_cut_short_are_leaves():
    """Two chains: chain 0 ends after one token (3, a stop token), chain 1 drafts three. The
    target wants 2 first, then 0: chain 0 is rejected, chain 1 accepted at depth 0 and
    rejected at depth 1, the residual gives 0; no candidate past a chain's end is tried.
    When both chains end at the accepted node, the next token is the bonus at that leaf."""
    v = 4
    drafted = torch.tensor([[[3, 0, 0], [2, 1, 1]]])
    q = torch.full((1, 2, 3, v), 0.25)
    p = torch.full((1, 2, 4, v), 0.25)
    p[0, :, 0] = torch.tensor([0.0, 0.0, 1.0, 0.0])
    p[0, 1, 1] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    u = torch.full((1, 1), 0.1, dtype=torch.float64)
    out = multi_draft_verify(drafted, torch.tensor([[1, 3]]), q, p, torch.zeros(1, 3, 2), u)
    assert (int(out.accepted), int(out.chain), int(out.token)) == (1, 1, 0)
    assert out.tried.tolist() == [[2, 1, 0]]
    leaf = torch.tensor([[[3, 0, 0], [3, 1, 1]]])
    p[0, :, 0] = torch.tensor([0.0, 0.0, 0.0, 1.0])
    p[0, :, 1] = torch.tensor([0.0, 1.0, 0.0, 0.0])  # the target's bonus after 3
    out = multi_draft_verify(leaf, torch.tensor([[1, 1]]), q, p, torch.zeros(1, 3, 2), u)
    assert (int(out.accepted), int(out.token)) == (1, 1)
    assert out.tried.tolist() == [[1, 0, 0]]


# ------------------------------------------------------------------------- the decoder
PROMPT = [1, 2, 0]


@pytest.fixture(scope="module")
def pair():
    return tiny_transformer(seed=1, vocab=8), tiny_transformer(seed=2, vocab=8)


def _run(pair, mode: str, cfg: GenerationConfig, seed: int = 5):
    for m in pair:
        m.rounds = mode
    try:
        g = torch.Generator().manual_seed(seed)
        return decode_multi_sd(*pair, PROMPT, cfg, frozenset(), 8, g)
    finally:
        for m in pair:
            m.rounds = "auto"


@pytest.mark.parametrize(("n", "k", "top_k"), [(4, 3, 0), (2, 5, 5), (8, 2, 0)])
def test_fused_rounds_draw_what_the_steps_draw(pair, n, k, top_k, monkeypatch):
    cfg = GenerationConfig(method="sd", max_new_tokens=40, particles=n, draft_tokens=k,
                           temperature=1.0, draft_temperature=0.8, top_k=top_k,
                           ignore_eos=True)  # fmt: skip
    steps = _run(pair, "steps", cfg)
    rounds = []
    fused_round = multi_sd.multi_sd_round
    monkeypatch.setattr(multi_sd, "multi_sd_round", lambda *a: rounds.append(1) or fused_round(*a))
    fused = _run(pair, "eager", cfg)
    assert rounds  # the fused path ran
    assert fused.tokens == steps.tokens
    assert fused.stats.to_dict() == steps.stats.to_dict()
    assert 0 < steps.stats.accepted < steps.stats.drafted  # rejections and acceptances


def test_the_decoder_table_runs_n_chains_as_multi_draft():
    sd = GenerationConfig(method="sd")
    assert sd.particles == 1 and decoder_for(sd) is DECODERS["sd"]
    multi = GenerationConfig(method="sd", particles=8, draft_tokens=4)
    assert decoder_for(multi) is DECODERS["multi-sd"]
    assert DECODERS["multi-sd"].label(8, 4) == "sd-n8-k4"
    label = parse_label("sd-n8-k4")
    assert (label.decoder.name, label.particles, label.draft_tokens) == ("multi-sd", 8, 4)
    # greedy: every chain would be the draft's argmax chain, so it runs as chain sd
    assert decoder_for(GenerationConfig(method="sd", particles=8, temperature=0)) is DECODERS["sd"]
    assert GenerationConfig().particles == 4  # smc keeps its default N


def test_bad_settings_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="n-gram drafts are one chain"):
        decoder_for(GenerationConfig(method="sd", particles=4, draft="ngram"))
    with pytest.raises(ConfigError, match="particles N must be in"):
        GenerationConfig(method="sd", particles=0).validate()
    dirs = make_tiny_chat_pair(tmp_path)
    engine = Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))
    ok = GenerationConfig(method="sd", particles=3, draft_tokens=2, max_new_tokens=6, seed=1)
    job = engine.prepare("ab cd", ok, chat=True)
    needs = pool_needs(engine.models(), engine.cache_needs(job))
    for role, model in engine.models().items():  # pools that hold 3 chains, not 4
        model.kv_budget_bytes = int(needs[role]["kv_bytes"] * 1.2)
    with pytest.raises(ContextLengthError, match="can never fit"):  # refused before it runs
        engine.generate("ab cd", replace(ok, particles=4))
    result = engine.generate("ab cd", ok)
    assert result.stats["particles"] == 3 and len(result.token_ids) <= 6
