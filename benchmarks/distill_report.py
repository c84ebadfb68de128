"""Tables of issue 84's measurements, from the committed records (no model runs).

* the validation curves (``docs/benchmarks/distill/validation-<objective>.jsonl``, every
  objective that has one): per-token
  D2, KL, TV and chain sd's acceptance ``1 - TV`` per domain at each measured token count;
* GSM8K first 100 (``docs/benchmarks/distill-gsm8k/results.jsonl``: the fitted draft's
  SMC-SD settings and copies of ``ar``'s records) against ``ar`` and against the base draft's
  committed records (``docs/benchmarks/gsm8k-gpu-settings/results.jsonl``), paired by
  question: right answers, the exact McNemar p-value, mean round ESS, resampling rate,
  tokens a round and the H200 tokens/s they predict (:func:`predicted_h200`); the same for the
  kl draft's run (``distill-gsm8k/kl-draft-t0.6/``) once it has records;
* HumanEval first 50 (``docs/benchmarks/distill-humaneval/{base,chi2}/results.jsonl``);
* tokens a round of chain and multi-draft sd (``docs/benchmarks/distill/acceptance-*/`` against
  ``docs/benchmarks/multi-draft-cpu/records.jsonl``, the same prompts and seeds), with the
  predicted H200 tokens/s of each (``multi_draft_acceptance.h200_round_seconds``).

Usage: .venv/bin/python benchmarks/distill_report.py > docs/benchmarks/distill/tables.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from scipy import stats

sys.path.insert(0, str(Path(__file__).parent))
from multi_draft_acceptance import h200_round_seconds, tokens_a_round  # noqa: E402

from smcspec.eval.stats import mcnemar_pvalue  # noqa: E402

DOCS = Path("docs/benchmarks")


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def validation_table(objective: str) -> list[str]:
    rows = _jsonl(DOCS / "distill" / f"validation-{objective}.jsonl")
    if not rows:
        return [f"(no validation records for {objective} yet)"]
    last = {}
    for r in rows:  # a resumed run may repeat a pass: the last one written counts
        last[(r["tokens"], r["domain"])] = r
    lines = [
        f"| {objective}: tokens | domain | D2 | KL | TV | acceptance 1 - TV |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for (tokens, domain), r in sorted(last.items()):
        lines.append(
            f"| {tokens:,} | {domain} | {r['d2']:.4f} | {r['kl']:.4f} | {r['tv']:.4f} "
            f"| {r['acceptance']:.4f} |"
        )
    return lines


def smc_stats(recs: list[dict]) -> tuple[float, float, float]:
    """Mean round ESS (the mean of each record's ``stats.mean_ess``), the resampling rate and
    tokens a round over ``recs``, both pooled: all resamples (new tokens) over all rounds.
    NaN where the records carry none."""
    ess = [r["stats"]["mean_ess"] for r in recs if "mean_ess" in r["stats"]]
    rounds = sum(r["stats"].get("rounds", 0) for r in recs)
    resamples = sum(r["stats"].get("resamples", 0) for r in recs)
    tokens = sum(r["new_tokens"] for r in recs)
    mean_ess = sum(ess) / len(ess) if ess else float("nan")
    return (
        mean_ess,
        resamples / rounds if rounds else float("nan"),
        (tokens / rounds if rounds else float("nan")),
    )


def predicted_h200(n: int, k: int, tokens_a_round: float, h200: dict) -> float:
    """A **prediction**: tokens a round over the H200's seconds a round at N particles and K
    drafts (:func:`multi_draft_acceptance.h200_round_seconds`, Llama-3.1-8B / 3.2-1B shapes),
    linear in K between the two measured K around it at the same N where K itself was not
    measured; NaN outside the measured K."""
    if (n, k) in h200:
        return tokens_a_round / h200[(n, k)]
    ks = sorted(kk for nn, kk in h200 if nn == n)
    lo = max((kk for kk in ks if kk < k), default=None)
    hi = min((kk for kk in ks if kk > k), default=None)
    if lo is None or hi is None:
        return float("nan")
    t = (k - lo) / (hi - lo)
    return tokens_a_round / ((1 - t) * h200[(n, lo)] + t * h200[(n, hi)])


def _paired(a: dict[str, bool], b: dict[str, bool]) -> tuple[int, int, int, float]:
    items = sorted(set(a) & set(b))
    x, y = [a[i] for i in items], [b[i] for i in items]
    return len(items), sum(x), sum(y), mcnemar_pvalue(x, y) if items else float("nan")


def task_table(task: str, fitted: list[dict], base: list[dict], settings: list[str]) -> list[str]:
    def by(recs: list[dict], method: str) -> dict[str, bool]:
        return {r["item"]: bool(r["correct"]) for r in recs if r["method"] == method}

    ar = by(fitted, "ar")
    lines = [
        f"| {task} setting | draft | answered | right | `ar` right (same items) | p vs `ar` "
        "| base right (same items) | p vs base | mean ESS | resamples a round | tokens a round "
        "| predicted H200 tokens/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    h200 = h200_round_seconds()
    for s in settings:
        for label, recs in (("fitted", fitted), ("base", base)):
            mine = by(recs, s)
            if not mine:
                continue
            n, right_ar, right, p_ar = _paired(ar, mine) if ar else (len(mine), 0, 0, float("nan"))
            draft = next((r.get("draft", "base") for r in recs if r["method"] == s), "?")
            cells = [f"`{s}`", draft, str(len(mine)), str(sum(mine.values())),
                     str(right_ar) if ar else "-", f"{p_ar:.3f}" if ar else "-"]  # fmt: skip
            if label == "fitted":
                other = by(base, s)
                n_b, right_b, _, p_b = _paired(other, mine) if other else (0, 0, 0, float("nan"))
                cells += [str(right_b) if other else "-", f"{p_b:.3f}" if other else "-"]
            else:
                cells += ["-", "-"]
            ess, rate, tpr = smc_stats([r for r in recs if r["method"] == s])
            n_k = [int(v[1:]) for v in s.split("-")[1:]]  # smc-n8-k8 -> [8, 8]
            pred = predicted_h200(n_k[0], n_k[1], tpr, h200) if len(n_k) == 2 else float("nan")
            cells += [f"{ess:.2f}", f"{rate:.2f}", f"{tpr:.2f}", f"{pred:.0f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _paired_row(name: str, setting: str, mine: list[dict], theirs: list[dict], cost: float) -> str:
    """One table row: a fitted draft's records against the base draft's on the same prompts."""
    t, b = tokens_a_round(mine), tokens_a_round(theirs)
    base_of = {o["prompt"]: o for o in theirs}
    diff = [tokens_a_round([r]) - tokens_a_round([base_of[r["prompt"]]]) for r in mine]
    lower, higher = sum(d < 0 for d in diff), sum(d > 0 for d in diff)
    p = stats.wilcoxon(diff).pvalue if lower + higher else float("nan")

    def by(workload: str) -> str:
        def one(rows: list[dict]) -> float:
            return tokens_a_round([r for r in rows if r["workload"] == workload])

        return f"{one(mine):.2f} / {one(theirs):.2f}"

    return (
        f"| {name} | `{setting}` | {len(mine)} | {t:.2f} | {b:.2f} | {t / b:.3f} "
        f"| {lower} / {higher} ({p:.3f}) | {by('chat')} | {by('code')} "
        f"| {t / cost:.0f} / {b / cost:.0f} |"
    )


def acceptance_table() -> list[str]:
    """Tokens a round of each fitted draft against the base draft's on the prompts both ran.

    Each fitted draft is paired with the base draft on its own common prompts (a draft still
    running does not shrink another's pairing), and each prompt's tokens a round is compared
    with the base draft's (Wilcoxon signed-rank test, ties dropped, :func:`scipy.stats.wilcoxon`).
    The H200 prediction is tokens a round over the committed round cost of that (N, K) (N=1
    priced as N=2, the smallest measured).
    """
    base = [r for r in _jsonl(DOCS / "multi-draft-cpu" / "records.jsonl")
            if r["setting"] in ("sd-k4", "sd-n8-k4")]  # fmt: skip
    h200 = h200_round_seconds()
    lines = [
        "| draft | setting | prompts | tokens a round | base draft (same prompts) | x base "
        "| prompts lower / higher (Wilcoxon p) | chat: fitted / base | code: fitted / base "
        "| predicted H200 tokens/s: fitted / base |",
        "|---|---|---:|---:|---:|---:|---|---|---|---|",
    ]
    for folder in sorted((DOCS / "distill").glob("acceptance-*")):
        fitted = _jsonl(folder / "records.jsonl")
        for setting in ("sd-k4", "sd-n8-k4"):
            theirs = {r["prompt"]: r for r in base if r["setting"] == setting}
            mine = [r for r in fitted if r["setting"] == setting and r["prompt"] in theirs]
            if not mine:
                continue
            n, k = mine[0]["particles"], mine[0]["draft_tokens"]
            cost = h200.get((max(n, 2), k), float("nan"))
            name = folder.name.removeprefix("acceptance-")
            row = _paired_row(name, setting, mine, [theirs[r["prompt"]] for r in mine], cost)
            lines.append(row)
    return lines


def main() -> int:
    out = ["## Validation curves", ""]
    for objective in ("chi2", "kl", "anneal", "reverse-kl"):
        if (DOCS / "distill" / f"validation-{objective}.jsonl").is_file():
            out += validation_table(objective) + [""]
    gsm_base = _jsonl(DOCS / "gsm8k-gpu-settings" / "results.jsonl")
    runs = (("the chi2 draft", "."), ("the kl draft at draft T 0.6", "kl-draft-t0.6"))
    for title, folder in runs:
        gsm = _jsonl(DOCS / "distill-gsm8k" / folder / "results.jsonl")
        if any(r["method"] != "ar" for r in gsm):
            out += [f"## GSM8K, first 100, {title}", ""]
            out += task_table("GSM8K", gsm, gsm_base, ["smc-n4-k12", "smc-n8-k8"]) + [""]
    he_fit = _jsonl(DOCS / "distill-humaneval" / "chi2" / "results.jsonl")
    he_base = _jsonl(DOCS / "distill-humaneval" / "base" / "results.jsonl")
    out += ["## HumanEval, first 50", ""]
    out += task_table("HumanEval", he_fit, he_base, ["smc-n8-k8"]) + [""]
    out += ["## Tokens a round, 20 chat and 20 code prompts", ""] + acceptance_table()
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
