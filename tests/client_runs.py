"""Running clients nobody here wrote against a live server: lm-eval's CLI on two local tasks
and aiperf's ``profile`` in fixed-length mode, each from a venv of its own
(:mod:`client_venvs`), and what their runs must show. Used by tests/test_clients_tiny.py
(the tiny pair) and tests/test_real_clients.py (the default pair).

The tasks and the tokenizer are files the tests write (a copy of lm-eval's own GSM8K task
reading 8 questions of the packaged test split); nothing comes from the Hugging Face hub
(lm-eval runs with ``HF_HUB_OFFLINE=1``; aiperf, which reads any such value as "look the
tokenizer up in the hub cache", with ``HF_ENDPOINT`` pointing at a closed port).
"""

from __future__ import annotations

import json
import subprocess
from itertools import islice
from pathlib import Path

from client_venvs import client_bin, offline_env
from live_server import Server

from smcspec.eval.gsm8k import packaged_test_path

MODEL = "tiny"
"""The name the test servers serve their model as."""
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
