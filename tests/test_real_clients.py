"""Clients nobody here wrote against a real server of the default pair (llama.cpp, the
session's ``real_engine``): lm-eval's ``local-completions`` (multiple choice and GSM8K) and
``local-chat-completions`` (GSM8K), and aiperf's ``profile`` in fixed-length mode, each run
as its own CLI at its default model settings (:mod:`client_runs`). The same clients on the
tiny pair, every document: tests/test_clients_tiny.py.
"""

from __future__ import annotations

import pytest
import torch
from client_runs import MODEL, aiperf, check_profile, lm_eval, samples, write_tasks
from live_server import Server

from smcspec import GenerationConfig
from smcspec.server import create_app


# ------------------------------------------------------------------ the default pair
@pytest.fixture(scope="module")
def real(tmp_path_factory, real_engine):
    """A server of the session's default pair (llamacpp; ``conftest.real_engine``), served
    as ``tiny``'s name with 256 new tokens a request, and its tokenizer saved as a
    directory."""
    root = tmp_path_factory.mktemp("clients-real")
    engine = real_engine
    tok_dir = root / "tokenizer"
    engine.tokenizer.save_pretrained(str(tok_dir))
    srv = Server(create_app(engine, GenerationConfig(max_new_tokens=256), model_name=MODEL))
    yield srv, tok_dir, engine
    srv.stop()


def engine_loglikelihood(engine, tok, context: str, continuation: str) -> tuple[float, int]:
    """The same loglikelihood from the engine's own target (its prefill's logits at every
    position), split into tokens as lm-eval splits it; and the continuation's tokens."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    model = engine.target.model
    cache = model.new_cache(1, 1)
    try:
        logits = model.prefill(torch.tensor(whole), cache, all_logits=True)
    finally:
        cache.close()
    lp = torch.log_softmax(logits[:, : engine.vocab].float(), -1)
    rows = lp[len(ctx) - 1 : len(whole) - 1]
    cont = whole[len(ctx) :]
    return float(rows.gather(-1, torch.tensor(cont)[:, None]).sum()), len(cont)


LIMIT = ("--limit", "1")
"""The default pair's lm-eval runs take each task's first document (16 new tokens an answer):
the real tokenizer and template through each model type; the tiny pair's tests
(tests/test_clients_tiny.py) run every document."""


@pytest.mark.slow
@pytest.mark.real_pair
@pytest.mark.clients("lm-eval")
def test_lm_eval_both_model_types_on_the_default_pair(real, tmp_path):
    """lm-eval's ``local-completions`` (multiple choice and GSM8K, its defaults) and
    ``local-chat-completions`` (GSM8K) on the default pair, 1 document a task: every
    request answered, each loglikelihood the target's own within llama.cpp's batch
    arithmetic (0.05 a token)."""
    srv, tok_dir, engine = real
    from transformers import AutoTokenizer

    tasks = write_tasks(tmp_path)
    out = tmp_path / "completions"
    res = lm_eval(srv, out, tasks, "local-completions", "mc_local,gsm8k_local", *LIMIT,
                  "--gen_kwargs", "max_gen_toks=16", model_args=f"tokenizer={tok_dir}")  # fmt: skip
    assert 0 <= res["results"]["mc_local"]["acc,none"] <= 1
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    for s in samples(out, "mc_local"):
        for args, resp in zip(s["arguments"].values(), s["resps"], strict=True):
            want, tokens = engine_loglikelihood(engine, tok, args["arg_0"], args["arg_1"])
            assert abs(float(resp[0][0]) - want) < 0.05 * tokens, (args, resp, want)
    assert len({s["doc_id"] for s in samples(out, "gsm8k_local")}) == 1
    out = tmp_path / "chat"
    res = lm_eval(srv, out, tasks, "local-chat-completions", "gsm8k_local", *LIMIT,
                  "--apply_chat_template", "--gen_kwargs", "max_gen_toks=16")  # fmt: skip
    assert "exact_match,flexible-extract" in res["results"]["gsm8k_local"]
    assert len({s["doc_id"] for s in samples(out, "gsm8k_local")}) == 1


@pytest.mark.slow
@pytest.mark.real_pair
@pytest.mark.clients("aiperf")
def test_aiperf_on_the_default_pair(real, tmp_path):
    """aiperf at concurrency 4, 4 requests of 16 tokens in fixed-length mode, on the server's
    default method (SMC-SD, N 4, K 4): no errors, every answer 16 tokens (the real
    tokenizer and template; 8 requests at concurrency 4: the tiny pair's test). Fails with
    ``ignore_eos`` and ``min_tokens`` dropped from the request (tried at 16 tokens on
    2026-12-07: answers end at EOS)."""
    srv, tok_dir, _ = real
    out = tmp_path / "c4"
    check_profile(aiperf(srv, tok_dir, out, 4, 4, 16), out, 4, 16)
