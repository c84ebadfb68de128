"""Clients nobody here wrote, against a real server: lm-eval's ``local-completions`` and
``local-chat-completions`` and aiperf's ``profile``, each run as its own CLI from a venv of
its own (:mod:`client_venvs`), at their default model settings.

* lm-eval ``local-completions`` on a local multiple-choice task (loglikelihood: ``echo``,
  ``logprobs`` and prompts as lists of token lists, what it sends by default) and a local
  8-question GSM8K task (generation); every loglikelihood it logs equals the target's
  recomputed with transformers for the same tokens.
* lm-eval ``local-chat-completions`` on the local GSM8K task (its chat template applied).
* aiperf ``profile`` on the streaming chat endpoint at concurrency 1 and 4 in fixed-length
  mode (``ignore_eos`` and ``min_tokens`` extras): no errors, every answer as long as asked.

The tasks and the tokenizer are files the tests write (a copy of lm-eval's own GSM8K task
reading 8 questions of the packaged test split); nothing comes from the Hugging Face hub
(lm-eval runs with ``HF_HUB_OFFLINE=1``; aiperf, which reads any such value as "look the
tokenizer up in the hub cache", with ``HF_ENDPOINT`` pointing at a closed port).

Tiny models in the fast tier (lm-eval: about 10 s of CPU a run, most of it lm-eval's own
start), aiperf (about 25 s of CPU a run: it starts a dozen processes) and the default pair in
the slow tier.
"""

from __future__ import annotations

import json
import subprocess
from itertools import islice
from pathlib import Path

import pytest
import torch
from client_venvs import client_bin, offline_env
from live_server import Server
from tiny_models import make_tiny_chat_pair

from smcspec import Engine, GenerationConfig
from smcspec.backends.torch import load_hf_dir
from smcspec.eval.gsm8k import packaged_test_path
from smcspec.server import create_app

MODEL = "tiny"
RUN_TIMEOUT_S = 1800  # bounds a hung client only

GSM8K_TASK = """task: gsm8k_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
fewshot_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore:
      - ","
      - "\\\\$"
      - "(?s).*#### "
      - "\\\\.$"
generation_kwargs:
  until:
    - "Question:"
    - "</s>"
    - "<|im_end|>"
  do_sample: false
  temperature: 0.0
repeats: 1
num_fewshot: 0
filter_list:
  - name: "strict-match"
    filter:
      - function: "regex"
        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"
      - function: "take_first"
  - name: "flexible-extract"
    filter:
      - function: "regex"
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{{2,}})|(-?[0-9]+)"
      - function: "take_first"
metadata:
  version: 3.0
"""
"""lm-eval 0.4.13's ``gsm8k.yaml`` with its dataset read from a local file (and no
few-shot examples, to keep prompts short)."""

MC_TASK = """task: mc_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

MC_DOCS = [
    {"question": "ab cd", "choices": [" ef", " gh", " ij kl", " mn"], "answer": 0},
    {"question": "op qr st", "choices": [" uv", " wx yz"], "answer": 1},
    {"question": "ab ab ab", "choices": [" ab", " cd", " ef gh"], "answer": 0},
]


def write_tasks(root: Path) -> Path:
    """The two tasks under ``root/tasks`` (lm-eval's ``--include_path``)."""
    tasks = root / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    with open(packaged_test_path()) as f:
        (tasks / "gsm8k8.jsonl").write_text("".join(islice(f, 8)))
    (tasks / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (tasks / "gsm8k_local.yaml").write_text(GSM8K_TASK.format(data=tasks / "gsm8k8.jsonl"))
    (tasks / "mc_local.yaml").write_text(MC_TASK.format(data=tasks / "mc.jsonl"))
    return tasks


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


def lm_eval(srv: Server, out: Path, tasks: Path, model: str, names: str, *extra: str,
            model_args: str = "") -> dict:  # fmt: skip
    """Run lm-eval's CLI (``model`` ``local-completions`` or ``local-chat-completions``) on
    the task ``names``; returns its results JSON (the per-sample logs next to it)."""
    path = "/v1/completions" if model == "local-completions" else "/v1/chat/completions"
    args = f"model={MODEL},base_url={srv.url(path)}" + (f",{model_args}" if model_args else "")
    cmd = [str(client_bin("lm-eval") / "lm_eval"), "--model", model, "--model_args", args,
           "--include_path", str(tasks), "--tasks", names, "--output_path", str(out),
           "--log_samples", *extra]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          env=offline_env(OPENAI_API_KEY="none"))  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    results = list(out.rglob("results_*.json"))
    assert len(results) == 1, (results, done.stderr[-3000:])
    return json.loads(results[0].read_text())


def samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


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


def aiperf(srv: Server, tok_dir: Path, out: Path, concurrency: int, requests: int,
           tokens: int) -> dict:  # fmt: skip
    """aiperf ``profile`` on the streaming chat endpoint, fixed-length mode; returns its
    summary JSON."""
    cmd = [str(client_bin("aiperf") / "aiperf"), "profile", "--model", MODEL,
           "--url", srv.url(""), "--endpoint-type", "chat", "--streaming",
           "--tokenizer", str(tok_dir), "--concurrency", str(concurrency),
           "--request-count", str(requests), "--synthetic-input-tokens-mean", "16",
           "--output-tokens-mean", str(tokens), "--output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{tokens}",
           "--use-server-token-count", "--output-artifact-dir", str(out),
           "--ui-type", "none"]  # fmt: skip
    env = {
        k: v
        for k, v in offline_env().items()
        if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # the hub: a closed port
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads((out / "profile_export_aiperf.json").read_text())


def check_profile(summary: dict, out: Path, requests: int, tokens: int) -> None:
    """No errors, every request answered with exactly ``tokens`` tokens (the server's
    usage), TTFT and inter-token latency measured."""
    assert summary["request_count"]["avg"] == requests
    assert not summary.get("error_summary"), summary.get("error_summary")
    records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == requests
    assert all(r["metrics"]["usage_completion_tokens"]["value"] == tokens for r in records)
    assert summary["time_to_first_token"]["avg"] > 0
    assert summary["inter_token_latency"]["avg"] > 0


@pytest.mark.slow
def test_aiperf_profile_streaming_chat_fixed_length(tiny, tmp_path):
    """aiperf at concurrency 1 (4 requests) and 4 (8 requests), 8 tokens each in
    fixed-length mode, on the default method (smc): no errors, every answer 8 tokens.
    Fails on cb48c1a (``ignore_eos`` and ``min_tokens`` ignored: answers end at EOS)."""
    srv, tok_dir, _ = tiny
    for concurrency, requests in ((1, 4), (4, 8)):
        out = tmp_path / f"c{concurrency}"
        check_profile(aiperf(srv, tok_dir, out, concurrency, requests, 8), out, requests, 8)


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


LIMIT = ("--limit", "2")
"""The default pair's lm-eval runs take each task's first 2 documents (32 new tokens an
answer): the real tokenizer and template through each model type; the tiny pair's tests
above run every document."""


@pytest.mark.slow
@pytest.mark.real_pair
def test_lm_eval_both_model_types_on_the_default_pair(real, tmp_path):
    """lm-eval's ``local-completions`` (multiple choice and GSM8K, its defaults) and
    ``local-chat-completions`` (GSM8K) on the default pair, 2 documents a task: every
    request answered, each loglikelihood the target's own within llama.cpp's batch
    arithmetic (0.05 a token)."""
    srv, tok_dir, engine = real
    from transformers import AutoTokenizer

    tasks = write_tasks(tmp_path)
    out = tmp_path / "completions"
    res = lm_eval(srv, out, tasks, "local-completions", "mc_local,gsm8k_local", *LIMIT,
                  "--gen_kwargs", "max_gen_toks=32", model_args=f"tokenizer={tok_dir}")  # fmt: skip
    assert 0 <= res["results"]["mc_local"]["acc,none"] <= 1
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    for s in samples(out, "mc_local"):
        for args, resp in zip(s["arguments"].values(), s["resps"], strict=True):
            want, tokens = engine_loglikelihood(engine, tok, args["arg_0"], args["arg_1"])
            assert abs(float(resp[0][0]) - want) < 0.05 * tokens, (args, resp, want)
    assert len({s["doc_id"] for s in samples(out, "gsm8k_local")}) == 2
    out = tmp_path / "chat"
    res = lm_eval(srv, out, tasks, "local-chat-completions", "gsm8k_local", *LIMIT,
                  "--apply_chat_template", "--gen_kwargs", "max_gen_toks=32")  # fmt: skip
    assert "exact_match,flexible-extract" in res["results"]["gsm8k_local"]
    assert len({s["doc_id"] for s in samples(out, "gsm8k_local")}) == 2


@pytest.mark.slow
@pytest.mark.real_pair
def test_aiperf_on_the_default_pair(real, tmp_path):
    """aiperf at concurrency 1 and 4, 32 tokens each in fixed-length mode, on the server's
    default method (SMC-SD, N 4, K 4), 2 and 4 requests: no errors, every answer 32
    tokens."""
    srv, tok_dir, _ = real
    for concurrency, requests in ((1, 2), (4, 4)):
        out = tmp_path / f"c{concurrency}"
        check_profile(aiperf(srv, tok_dir, out, concurrency, requests, 32), out, requests, 32)
