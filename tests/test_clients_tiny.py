"""Clients nobody here wrote against a real server of the tiny chat pair (torch):
lm-eval's ``local-completions`` and ``local-chat-completions`` and aiperf's ``profile``, each
run as its own CLI at its default model settings (:mod:`client_runs`).

* lm-eval ``local-completions`` on a local multiple-choice task (loglikelihood: ``echo``,
  ``logprobs`` and prompts as lists of token lists, what it sends by default) and a local
  8-question GSM8K task (generation); every loglikelihood it logs equals the target's
  recomputed with transformers for the same tokens.
* lm-eval ``local-chat-completions`` on the local GSM8K task (its chat template applied).
* aiperf ``profile`` on the streaming chat endpoint at concurrency 1 and 4 in fixed-length
  mode (``ignore_eos`` and ``min_tokens`` extras): no errors, every answer as long as asked.

lm-eval about 10 s of CPU a run (most of it lm-eval's own start; the fast tier), aiperf
about 25 s (it starts a dozen processes; the slow tier). The default pair's runs are in
tests/test_real_clients.py. The first test to need a client builds its venv.
"""

from __future__ import annotations

import pytest
import torch
from client_runs import MC_DOCS, MODEL, aiperf, check_profile, lm_eval, samples, write_tasks
from live_server import Server
from tiny_models import make_tiny_chat_pair

from smcspec import Engine, GenerationConfig
from smcspec.backends.torch import load_hf_dir
from smcspec.server import create_app


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A server of the tiny chat pair (torch), its tokenizer's directory and the target
    loaded by transformers (for recomputing loglikelihoods)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("clients")
    # a directory name without '=' (aiperf takes a name with one for a hub repository)
    dirs = make_tiny_chat_pair(root / "models", max_position_embeddings=4096)
    tok_dir = root / "tokenizer"
    tok_dir.mkdir()
    for f in dirs[0].iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "config")):
            (tok_dir / f.name).write_bytes(f.read_bytes())
    engine = Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))
    srv = Server(create_app(engine, GenerationConfig(max_new_tokens=32), model_name=MODEL))
    hf = AutoModelForCausalLM.from_pretrained(str(dirs[0])).eval()
    yield srv, tok_dir, hf
    srv.stop()


def recomputed_loglikelihood(hf, tok, context: str, continuation: str) -> tuple[float, bool]:
    """The loglikelihood lm-eval asks for, by hand: its own split of ``context +
    continuation`` into tokens (lm-eval 0.4.13's ``_encode_pair``: trailing spaces of the
    context move to the continuation; the whole is encoded and the context's tokens cut
    off), summed target ``log_softmax`` of the continuation's tokens, and whether each is
    the target's most likely."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([whole])).logits[0].float(), -1)
    cont = whole[len(ctx) :]
    rows = lp[len(ctx) - 1 : len(whole) - 1]
    total = float(rows.gather(-1, torch.tensor(cont)[:, None]).sum())
    return total, bool((rows.argmax(-1) == torch.tensor(cont)).all())


@pytest.mark.clients("lm-eval")
def test_lm_eval_local_completions_loglikelihood_and_generation(tiny, tmp_path):
    """lm-eval ``local-completions`` at its defaults (tokenized requests: prompts as lists of
    token lists): the multiple-choice task's 9 loglikelihoods each equal the target's
    recomputed (1e-3: sums of float32 values over a few tokens; measured 4e-6), ``is_greedy``
    too, and the 8 GSM8K questions are answered. Fails on cb48c1a (every request a 400:
    ``prompt.str: Input should be a valid string``)."""
    srv, tok_dir, hf = tiny
    from transformers import AutoTokenizer

    tasks, out = write_tasks(tmp_path), tmp_path / "out"
    res = lm_eval(srv, out, tasks, "local-completions", "mc_local,gsm8k_local",
                  "--gen_kwargs", "max_gen_toks=8", model_args=f"tokenizer={tok_dir}")  # fmt: skip
    assert 0 <= res["results"]["mc_local"]["acc,none"] <= 1
    assert "exact_match,strict-match" in res["results"]["gsm8k_local"]
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    scored = 0
    for s in samples(out, "mc_local"):
        for args, resp in zip(s["arguments"].values(), s["resps"], strict=True):
            got, greedy = float(resp[0][0]), resp[0][1] == "True"
            want, want_greedy = recomputed_loglikelihood(hf, tok, args["arg_0"], args["arg_1"])
            assert abs(got - want) < 1e-3, (args, got, want)
            assert greedy == want_greedy
            scored += 1
    assert scored == sum(len(d["choices"]) for d in MC_DOCS)
    answers = samples(out, "gsm8k_local")
    assert len({s["doc_id"] for s in answers}) == 8
    assert all(isinstance(s["resps"][0][0], str) for s in answers)


@pytest.mark.clients("lm-eval")
def test_lm_eval_local_chat_completions_gsm8k(tiny, tmp_path):
    """lm-eval ``local-chat-completions`` (``--apply_chat_template``) answers the 8 local
    GSM8K questions; the ``smc`` object in ``--gen_kwargs`` reaches the server."""
    srv, _, _ = tiny
    tasks, out = write_tasks(tmp_path), tmp_path / "out"
    before = srv.metrics().get('smcspec_requests_total{"method": "ar", "outcome": "success"}', 0)
    res = lm_eval(srv, out, tasks, "local-chat-completions", "gsm8k_local",
                  "--apply_chat_template", "--gen_kwargs",
                  '{"max_gen_toks": 8, "smc": {"method": "ar"}}')  # fmt: skip
    assert "exact_match,flexible-extract" in res["results"]["gsm8k_local"]
    assert len({s["doc_id"] for s in samples(out, "gsm8k_local")}) == 8
    after = srv.metrics()['smcspec_requests_total{"method": "ar", "outcome": "success"}']
    assert after - before == 8


@pytest.mark.slow
@pytest.mark.clients("aiperf")
def test_aiperf_profile_streaming_chat_fixed_length(tiny, tmp_path):
    """aiperf at concurrency 4 (8 requests), 8 tokens each in fixed-length mode, on the
    default method (smc): no errors, every answer 8 tokens (one run: each of aiperf's
    runs starts its own processes, about 15 s on 2 cores). Fails on cb48c1a
    (``ignore_eos`` and ``min_tokens`` ignored: answers end at EOS)."""
    srv, tok_dir, _ = tiny
    out = tmp_path / "c4"
    check_profile(aiperf(srv, tok_dir, out, 4, 8, 8), out, 8, 8)
