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
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from smcspec.aggregate import Vote
from smcspec.config import GenerationConfig
from smcspec.decoding.labels import LABEL_HELP, Label, parse_label
from smcspec.decoding.output import hit_token_cap
from smcspec.decoding.registry import BASELINE, Decoder, decoder_for, method_decoder
from smcspec.engine import Engine, GenerationResult
from smcspec.errors import ConfigError
from smcspec.eval import baselines, gsm8k, humaneval
from smcspec.eval.fidelity import target_nll
from smcspec.eval.results import ResultFile
from smcspec.rewards import CodeExamples, arithmetic_reward, examples_from_prompt

PAUSE_FILE = "PAUSE"
"""While a file of this name exists beside the results file, a run waits before its next
answer (``touch OUT/PAUSE``; remove it to go on): the machine can then be timed or tested
without the run beside it, and without an answer's wall time counting the pause."""

REWARD_BETA = 5.0
"""beta of ``-reward`` settings without a number (``smc-n8-k2-reward``): on HumanEval exp(5 R)
weighs an answer that passes every example e^5 (about 150) times one that passes none; on
GSM8K each false equation divides a particle's weight by e^5."""


@dataclass(frozen=True)
class MethodSpec:
    """A named decoding setting, e.g. ``smc-n4-k4``.

    Attributes:
        name: as the reports name it.
        config: the decoding setting.
        samples: ``ar`` samples per item (best-of-n and self-consistency; 1 otherwise).
        select: ``"bon"`` (rerank by the reward), ``"sc"`` (majority answer) or None.
        reward_beta: smc steered by the task's reward with this beta (HumanEval: the share
            of the prompt's examples passed; GSM8K: minus the false equations,
            :mod:`smcspec.rewards.arithmetic`); None: no reward.
        vote: smc answers with the weighted vote over its particles.
    """

    name: str
    config: GenerationConfig
    samples: int = 1
    select: str | None = None
    reward_beta: float | None = None
    vote: bool = False


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
    for name in [m.strip() for m in methods.split(",") if m.strip()]:
        specs += _specs_named(name, base, ns, ks)
    for s in specs:
        decoder_for(s.config.validate())  # the table's checks too (a vote needs particles)
    return specs


def _specs_named(
    name: str, base: GenerationConfig, ns: list[int], ks: list[int]
) -> list[MethodSpec]:
    """The specs one name stands for: a bare method (``ar``, ``sd``, ``smc``: its grid), or a
    setting's label (:mod:`smcspec.decoding.labels`): a baseline on ``ar`` (``ar-greedy``,
    ``ar-sc-nN``, ``ar-bon-nN``), or a setting as the decoder table names it (``sd-k4``,
    ``sd-ngram-k4``, ``smc-n8-k2``), which for particles may carry the suffixes of
    :func:`_particle_spec`. Raises :class:`ConfigError`."""
    d = method_decoder(name)
    if d is not None:  # a bare method: each (N, K) of the grid it has
        return [
            MethodSpec(d.label(n, k), _configure(d, base, n, k))
            for n in (ns if d.particles else [1])
            for k in (ks if d.draft_tokens else [0])
        ]
    label = parse_label(name)
    if label is None:
        raise ConfigError(f"unknown method {name!r}; choose from {LABEL_HELP}")
    if label.baseline:
        ar = replace(base, method=BASELINE.method)
        if label.greedy:
            return [MethodSpec(name, replace(ar, temperature=0.0))]
        if not 1 <= label.samples <= 64:
            raise ConfigError(f"{name}: n must be in [1, 64]")
        return [MethodSpec(name, ar, label.samples, label.select)]
    cfg = _configure(label.decoder, base, label.particles, label.draft_tokens)
    if label.decoder.particles:
        return [_particle_spec(name, label, cfg)]
    return [MethodSpec(name, cfg)]


def _configure(d: Decoder, base: GenerationConfig, n: int, k: int) -> GenerationConfig:
    """``base`` on decoder ``d`` at N = ``n``, K = ``k``: particles draft with the draft
    model, n-gram sd with n-grams, sd as ``base.draft`` says."""
    if d.from_text or d.uses_n:
        return d.configure(base, n, k)
    if d.draft_tokens:  # chain sd, drafting as ``base.draft`` says
        return replace(base, method=d.method, draft_tokens=k, particles=1)
    return d.configure(base)


def _particle_spec(name: str, label: Label, cfg: GenerationConfig) -> MethodSpec:
    """A particle setting's suffixes (:class:`~smcspec.decoding.labels.Label`): ``-keep`` (the
    paper's rule for finished particles), ``-aALPHA`` (power target), ``-reward[BETA]`` (the
    task's reward, beta :data:`REWARD_BETA` without a number), ``-gG`` (G particle groups
    resampled apart), ``-ess`` (rounds cut where the ESS falls, ``round_end="ess"``),
    ``-epsEPS`` (the epsilon stop, ``stop_epsilon``) and ``-vote`` (the weighted vote
    answers)."""
    cfg = replace(cfg, finished_particles="keep" if label.keep else "bank")
    if label.alpha is not None:
        cfg = replace(cfg, alpha=label.alpha)
    if label.groups is not None:
        cfg = replace(cfg, groups=label.groups)
    if label.ess:
        cfg = replace(cfg, round_end="ess")
    if label.eps is not None:
        cfg = replace(cfg, stop_epsilon=label.eps)
    beta = None
    if label.reward:
        beta = label.beta if label.beta is not None else REWARD_BETA
    return MethodSpec(name, cfg, reward_beta=beta, vote=label.vote)


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
    ``hit_cap`` (cut by the budget, see :func:`smcspec.decoding.output.hit_token_cap`), ``seconds``,
    ``tokens_per_second``, ``stats``, ``draft`` (the draft model's name, where the method
    drafts with one: a fitted draft's is its manifest's, e.g. ``...-chi2``) and, with
    ``score_nll``, ``target_nll`` (mean nats per
    token of the output under the target at temperature 1) and, if given, ``machine`` (what
    generated it, e.g. :func:`smcspec.cli.engine_args.machine_line`: a resumed run may span
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
        wait_while_paused(results.path.parent / PAUSE_FILE)
        if task == "gsm8k":
            messages = gsm8k.build_messages(item.question)
        else:
            messages = _humaneval_messages(item)
        cfg = replace(spec.config, seed=seed + i)  # same seed for every method: paired
        ans = _answer(engine, task, item, spec, messages, cfg)
        r = ans.result
        score = _score_gsm8k if task == "gsm8k" else _score_humaneval
        scored = score(item, ans.text)
        if spec.vote:  # the drawn answer's score beside the vote's
            scored["drawn_correct"] = score(item, r.text)["correct"]
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
                "output": ans.text,
                **scored,
                **ans.extra,
                "new_tokens": ans.new_tokens,
                "max_new_tokens": cfg.max_new_tokens,
                "hit_cap": hit_token_cap(
                    r.token_ids, cfg.max_new_tokens, answer_stop_ids(engine, cfg)
                ),
                "seconds": round(ans.seconds, 3),
                "tokens_per_second": round(ans.new_tokens / ans.seconds, 3) if ans.seconds else 0.0,
                "stats": r.stats,
                **_draft_field(engine, cfg),
                **({"machine": machine} if machine else {}),
            }
        )
        bar.update(1)
    bar.close()
    return results.records()


def _draft_field(engine: Engine, cfg: GenerationConfig) -> dict[str, str]:
    """``{"draft": name}`` where ``cfg``'s decoder drafts with the draft model, else ``{}``."""
    if engine.draft is None or not decoder_for(cfg).draft_model:
        return {}
    return {"draft": engine.draft.name}


@dataclass
class _Answer:
    """One method's answer to one item: the text scored, the result whose stats and tokens
    are recorded (the chosen sample; smc's drawn answer), new tokens and wall seconds over
    every sample, and extra record fields."""

    text: str
    result: GenerationResult
    new_tokens: int
    seconds: float
    extra: dict[str, Any]


def _answer(
    engine: Engine, task: str, item, spec: MethodSpec, messages, cfg: GenerationConfig
) -> _Answer:
    """Decode ``item`` as ``spec`` says: one request; n batched ``ar`` samples reranked by
    the reward (``bon``) or voted (``sc``); smc with the task's reward and/or the vote."""
    examples = None
    if task == "humaneval" and (spec.reward_beta is not None or spec.vote or spec.select):
        examples = _examples(item)
    if task == "gsm8k":
        answer_fn = gsm8k.extract_answer
    elif examples is not None:
        answer_fn = examples.behaviour  # what the code does on the prompt's examples
    else:  # a prompt without examples: identical code only
        answer_fn = _code_answer(item)
    if spec.samples > 1 or spec.select:
        got = baselines.sample_batch(engine, messages, cfg, spec.samples)
        answers = [answer_fn(t) for t in got.texts]
        # distinct answers among the n independent samples: beside a vote's ``answers``
        # (distinct answers among the particles), it tells path degeneracy from low entropy
        extra = {"samples": spec.samples, "distinct_answers": len(set(answers) - {None})}
        if spec.select == "bon":
            scores = _scores(task, examples, got.texts)
            pick = baselines.best_of_n(scores)
            extra["rewards"] = scores
        else:
            pick = baselines.self_consistency(answers) or 0
        chosen = got.results[pick]
        return _Answer(chosen.text, chosen, got.new_tokens, got.seconds, extra)
    if task == "gsm8k" and spec.reward_beta is not None:
        cfg = replace(cfg, reward=arithmetic_reward(spec.reward_beta))
    elif examples is not None and spec.reward_beta is not None:
        cfg = replace(cfg, reward=examples.reward(spec.reward_beta))
    if spec.vote:
        cfg = replace(cfg, vote=Vote(answer_fn, "task answer"))
    r = engine.generate(messages, cfg)
    extra: dict[str, Any] = {}
    text = r.text
    if spec.vote:
        extra["vote"] = r.vote and {k: v for k, v in r.vote.items() if k != "text"}
        text = r.vote["text"] if r.vote else r.text
    if spec.reward_beta is not None and (task == "gsm8k" or examples is not None):
        extra["reward"] = _scores(task, examples, [r.text])[0]
    return _Answer(text, r, r.new_tokens, r.seconds, extra)


def _scores(task: str, examples: CodeExamples | None, texts: list[str]) -> list[float]:
    """The task's reward ``R`` of each text: GSM8K, minus its false equations
    (:mod:`smcspec.rewards.arithmetic`); HumanEval, the share of the prompt's examples passed
    (0 for every text when the prompt has none)."""
    if task == "gsm8k":
        return list(arithmetic_reward().fn(texts))  # R itself: beta does not enter it
    return examples.score(texts) if examples else [0.0] * len(texts)


def _code_answer(item: humaneval.HumanEvalProblem) -> Callable[[str], str | None]:
    def code(text: str) -> str | None:
        return humaneval.extract_code(text, item.prompt, item.entry_point).code.strip() or None

    return code


def _examples(item: humaneval.HumanEvalProblem) -> CodeExamples | None:
    """The execution reward's examples of a HumanEval problem (from its prompt, never its
    hidden tests); None when the prompt has none (then the reward is 0 for every answer)."""
    found = examples_from_prompt(item.prompt, item.entry_point)
    return CodeExamples(found, item.prompt, item.entry_point) if found else None


def wait_while_paused(pause: Path, poll_s: float = 2.0) -> None:
    """Return once ``pause`` does not exist (at once if it never did)."""
    while pause.exists():
        time.sleep(poll_s)


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
