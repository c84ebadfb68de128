"""Task accuracy runs: GSM8K and HumanEval, for several decoding methods, resumable.

Paired design: every method answers the same questions with the same per-question seed,
questions are visited in order and the methods alternate on each question. Each answer is
appended to a JSONL result file as soon as it is scored (one record per method and item),
so an interrupted run restarted with the same arguments skips what is done, and a finished
file can be re-scored without generating again (:func:`rescore`). The records' summaries and
``summary.md`` are :mod:`smcspec.eval.report`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from tqdm import tqdm

from smcspec.config import GenerationConfig
from smcspec.decoding.common import hit_token_cap
from smcspec.engine import Engine
from smcspec.errors import ConfigError
from smcspec.eval import gsm8k, humaneval
from smcspec.eval.fidelity import target_nll
from smcspec.eval.results import ResultFile


@dataclass(frozen=True)
class MethodSpec:
    """A named decoding setting, e.g. ``smc-n4-k4``."""

    name: str
    config: GenerationConfig


def method_specs(methods: str, base: GenerationConfig, grid: str | None = None) -> list[MethodSpec]:
    """Parse ``"ar,sd,smc"`` (and a grid like ``"N=2,4,8;K=2,4,8"`` for smc and sd), or
    settings named as the reports name them (``"ar,smc-n8-k2,smc-n4-k8,sd-k4"``,
    ``"sd-ngram-k4"``: sd with n-gram drafts, no draft model); an smc
    name ending in ``-keep`` (``"smc-n8-k2-keep"``) keeps finished particles among the
    running ones (the paper's rule, ``finished_particles="keep"``) instead of banking them.

    ``smc`` without a grid uses ``base``'s N and K; with a grid, one spec per (N, K) pair
    (sd: one per K). sd settings draft as ``base.draft`` says (``sd-kK``) or with n-grams
    (``sd-ngram-kK``); smc settings always draft with the draft model. Raises
    :class:`ConfigError` for an unknown method or a bad grid.
    """
    grid_vals: dict[str, list[int]] = {}
    if grid:
        for part in grid.split(";"):
            m = re.fullmatch(r"\s*([NK])\s*=\s*([\d,\s]+)", part)
            if not m:
                raise ConfigError(f"bad grid part {part!r}; expected e.g. 'N=2,4,8;K=2,4'")
            grid_vals[m.group(1)] = [int(v) for v in m.group(2).split(",") if v.strip()]
    ns = grid_vals.get("N", [base.particles])
    ks = grid_vals.get("K", [base.draft_tokens])
    specs: list[MethodSpec] = []
    for method in [m.strip() for m in methods.split(",") if m.strip()]:
        if method == "ar":
            specs.append(MethodSpec("ar", replace(base, method="ar")))
        elif method == "sd":
            specs += [
                MethodSpec(f"sd-k{k}", replace(base, method="sd", draft_tokens=k)) for k in ks
            ]
        elif m := re.fullmatch(r"smc-n(\d+)-k(\d+)(-keep)?", method):
            n, k = int(m.group(1)), int(m.group(2))
            rule = "keep" if m.group(3) else "bank"
            smc = replace(base, method="smc", particles=n, draft_tokens=k, draft="model")
            specs.append(MethodSpec(method, replace(smc, finished_particles=rule)))
        elif m := re.fullmatch(r"sd-ngram-k(\d+)", method):
            cfg = replace(base, method="sd", draft="ngram", draft_tokens=int(m.group(1)))
            specs.append(MethodSpec(method, cfg))
        elif m := re.fullmatch(r"sd-k(\d+)", method):
            k = int(m.group(1))
            specs.append(MethodSpec(method, replace(base, method="sd", draft_tokens=k)))
        elif method == "smc":
            specs += [
                MethodSpec(
                    f"smc-n{n}-k{k}",
                    replace(base, method="smc", particles=n, draft_tokens=k, draft="model"),
                )
                for n in ns
                for k in ks
            ]
        else:
            raise ConfigError(
                f"unknown method {method!r}; choose from ar, sd, smc, sd-kK, sd-ngram-kK, "
                "smc-nN-kK, smc-nN-kK-keep"
            )
    for s in specs:
        s.config.validate()
    return specs


def _score_gsm8k(item: gsm8k.Gsm8kItem, text: str) -> dict[str, Any]:
    pred = gsm8k.extract_answer(text)
    return {"extracted": pred, "gold": item.answer, "correct": gsm8k.is_correct(pred, item.answer)}


def _score_humaneval(item: humaneval.HumanEvalProblem, text: str) -> dict[str, Any]:
    code = humaneval.extract_code(text, item.prompt, item.entry_point)
    res = humaneval.run_completion(item, code.code, full_program=code.full_program)
    return {
        "extracted": code.code,
        "status": res.status,
        "detail": res.detail,
        "correct": res.passed,
    }


def _humaneval_messages(item: humaneval.HumanEvalProblem) -> list[dict[str, str]]:
    return [
        {
            "role": "user",
            "content": "Complete the following Python function. Reply with "
            "the whole function in one ```python code block.\n\n```python\n"
            f"{item.prompt}```",
        }
    ]


def answer_stop_ids(engine: Engine, cfg: GenerationConfig) -> frozenset[int]:
    """The tokens that end an answer of ``cfg`` (as :meth:`Engine.prepare` sets them)."""
    return frozenset() if cfg.ignore_eos else engine.stop_ids | set(cfg.stop_token_ids)


def run_task(
    engine: Engine,
    task: str,
    items: list,
    specs: list[MethodSpec],
    results: ResultFile,
    seed: int = 0,
    progress: bool = True,
    score_nll: bool = False,
    machine: str | None = None,
) -> list[dict[str, Any]]:
    """Answer ``items`` with every method in ``specs``; append one record per answer.

    Records: ``id`` (``"<method>/<item id>"``), ``item``, ``method``, ``prompt_id``,
    ``output``, ``extracted``, ``correct``, ``new_tokens``, ``max_new_tokens`` (the budget),
    ``hit_cap`` (cut by the budget, see :func:`smcspec.decoding.common.hit_token_cap`), ``seconds``,
    ``tokens_per_second``, ``stats`` and, with ``score_nll``, ``target_nll`` (mean nats per
    token of the output under the target at temperature 1) and, if given, ``machine`` (what
    generated it, e.g. :func:`smcspec.cli.common.machine_line`: a resumed run may span
    machines, see :func:`machines_note`). Returns all records of the file.
    """
    if task not in ("gsm8k", "humaneval"):
        raise ConfigError(f"unknown task {task!r}")
    done = results.done_ids()
    todo = [
        (i, item, s)
        for i, item in enumerate(items)
        for s in specs
        if f"{s.name}/{_item_id(item)}" not in done
    ]
    bar = tqdm(
        total=len(todo), desc=f"{task} ({len(specs)} methods)", unit="answer", disable=not progress
    )
    for i, item, spec in todo:
        if task == "gsm8k":
            messages = gsm8k.build_messages(item.question)
        else:
            messages = _humaneval_messages(item)
        cfg = replace(spec.config, seed=seed + i)  # same seed for every method: paired
        r = engine.generate(messages, cfg)
        scored = _score_gsm8k(item, r.text) if task == "gsm8k" else _score_humaneval(item, r.text)
        if score_nll:
            scored["target_nll"] = target_nll(
                engine.target.model, engine.encode(messages), r.token_ids
            )
        results.append(
            {
                "id": f"{spec.name}/{_item_id(item)}",
                "item": _item_id(item),
                "method": spec.name,
                "prompt_id": _item_id(item),
                "output": r.text,
                **scored,
                "new_tokens": r.new_tokens,
                "max_new_tokens": cfg.max_new_tokens,
                "hit_cap": hit_token_cap(
                    r.token_ids, cfg.max_new_tokens, answer_stop_ids(engine, cfg)
                ),
                "seconds": round(r.seconds, 3),
                "tokens_per_second": round(r.tokens_per_second, 3),
                "stats": r.stats,
                **({"machine": machine} if machine else {}),
            }
        )
        bar.update(1)
    bar.close()
    return results.records()


def _item_id(item) -> str:
    return item.id if hasattr(item, "id") else item.task_id


def rescore(task: str, records: list[dict[str, Any]], items: list) -> list[dict[str, Any]]:
    """Score stored outputs again (e.g. after an extraction fix) without generating."""
    by_id = {_item_id(it): it for it in items}
    out = []
    for rec in records:
        item = by_id[rec["item"]]
        score = _score_gsm8k if task == "gsm8k" else _score_humaneval
        out.append({**rec, **score(item, rec["output"])})
    return out
