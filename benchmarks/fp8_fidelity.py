"""What FP8 projections cost a real model: the default pair's weights as they are against the
same weights with FP8 projections (``smcspec.backends.torch.fp8``), on real text.

The GPU campaign runs FP8 with random weights (shapes only), so it says nothing about what the
rounding does to a model's distributions. Here the real default pair runs on the torch backend
(its GGUF files dequantized to float32) on this CPU, teacher-forced on real text: GSM8K
questions in the chat template, followed by the answer the target wrote for each (``ar``, the
committed GSM8K records). For every answer position, each model's next-token distribution
with its float32 projections (the reference) and with FP8 projections (a converted copy):

* KL(reference || FP8) in nats at T = 1 (what changes a sampled token's law),
* top-1 agreement (what changes a greedy token),
* the answer's negative log-likelihood per token under each (what changes fit to real text),
* total variation at T = 0.7 (the temperature every committed SMC-SD figure uses).

Writes ``OUT/results.json`` (per model and question) and ``OUT/summary.md``. Run:

    python benchmarks/fp8_fidelity.py --questions 12 --out docs/benchmarks/fp8-fidelity

CPU only by design (the FP8 GEMM is PyTorch's reference kernel here: slow, but the same
arithmetic as the GPU's up to summation order).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from smcspec import Engine
from smcspec.backends.torch.fp8 import convert_to_fp8
from smcspec.eval.gsm8k import build_messages, load_gsm8k
from smcspec.tuning.cache import cpu_model

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs/benchmarks/gsm8k-400/results.jsonl"


def answer_logits(model, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """float32 logits ``[len(answer), V]``: row j is the model's next-token logits before
    ``answer[j]`` (the prompt prefilled, then the answer but its last token in one block)."""
    cache = model.new_cache(1, len(answer) + 1)
    first = model.prefill(torch.tensor(prompt), cache)
    rest = model.decode(torch.tensor([answer[:-1]]), cache)[0]
    cache.close()
    return torch.cat((first[None], rest)).float()


def compare(ref: torch.Tensor, new: torch.Tensor, answer: list[int]) -> dict[str, float]:
    """The four measures of the module docstring over the rows of ``ref`` and ``new``."""
    lp_ref, lp_new = ref.log_softmax(-1), new.log_softmax(-1)
    kl = (lp_ref.exp() * (lp_ref - lp_new)).sum(-1)
    tv07 = 0.5 * ((ref / 0.7).softmax(-1) - (new / 0.7).softmax(-1)).abs().sum(-1)
    ids = torch.tensor(answer)[:, None]
    return {
        "tokens": len(answer),
        "kl_nats_mean": kl.mean().item(),
        "kl_nats_max": kl.max().item(),
        "top1_agreement": (ref.argmax(-1) == new.argmax(-1)).float().mean().item(),
        "nll_ref": -lp_ref.gather(-1, ids).mean().item(),
        "nll_fp8": -lp_new.gather(-1, ids).mean().item(),
        "tv_t07_mean": tv07.mean().item(),
    }


def texts(engine: Engine, questions: int, max_tokens: int) -> list[tuple[str, list, list]]:
    """(item id, prompt ids, answer ids) for the first ``questions`` ``ar`` records."""
    by_id = {item.id: item for item in load_gsm8k()}
    out = []
    for line in RECORDS.read_text().splitlines():
        r = json.loads(line)
        if r["method"] != "ar" or r["item"] not in by_id:
            continue
        prompt = engine.encode(build_messages(by_id[r["item"]].question))
        answer = engine.tokenizer.encode(r["output"], add_special_tokens=False)[:max_tokens]
        out.append((r["item"], prompt, answer))
        if len(out) == questions:
            break
    return out


def summary_md(result: dict) -> str:
    """The summary page: one row per model, means over questions (weighted by tokens)."""
    lines = [
        "# FP8 projections on the real default pair: what the rounding costs",
        "",
        f"{result['date_utc']} UTC, {result['machine']}; torch {result['torch']}. Command: "
        f"`{result['command']}`. Each model's float32 projections (the GGUF weights "
        "dequantized, the reference) against the same weights with FP8 projections, "
        f"teacher-forced on {result['questions']} GSM8K questions (chat template) followed by "
        "the target's own committed `ar` answers (docs/benchmarks/gsm8k-400/), "
        f"{result['max_tokens']} answer tokens at most each. See the script's docstring for "
        "the measures.",
        "",
        "| model | answer tokens | KL(ref ‖ FP8) nats/token, mean | max | top-1 agreement | "
        "NLL/token ref | NLL/token FP8 | TV at T = 0.7, mean |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for role, m in result["models"].items():
        rows = m["per_question"]
        n = sum(r["tokens"] for r in rows)

        def mean(key: str, rows=rows, n=n) -> float:
            return sum(r[key] * r["tokens"] for r in rows) / n

        lines.append(
            f"| {role} ({m['name']}) | {n} | {mean('kl_nats_mean'):.4f} | "
            f"{max(r['kl_nats_max'] for r in rows):.3f} | {mean('top1_agreement'):.3f} | "
            f"{mean('nll_ref'):.4f} | {mean('nll_fp8'):.4f} | {mean('tv_t07_mean'):.4f} |"
        )
    lines += ["", f"Seconds: {result['seconds']:.0f} (both models, both weight forms).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=192, help="answer tokens per question")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    engine = Engine.load(backend="torch", dtype="float32")
    items = texts(engine, args.questions, args.max_tokens)
    result = {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "machine": f"{cpu_model()} CPU, {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "command": " ".join(["python", "benchmarks/fp8_fidelity.py", *(argv or sys.argv[1:])]),
        "questions": len(items),
        "max_tokens": args.max_tokens,
        "models": {},
    }
    with torch.inference_mode():
        for role, loaded in (("target", engine.target), ("draft", engine.draft)):
            fp8 = copy.deepcopy(loaded.model)
            convert_to_fp8(fp8)
            rows = []
            for item, prompt, answer in items:
                ref = answer_logits(loaded.model, prompt, answer)
                new = answer_logits(fp8, prompt, answer)
                rows.append({"item": item, **compare(ref, new, answer)})
                print(role, rows[-1], flush=True)
            del fp8
            result["models"][role] = {"name": loaded.name, "per_question": rows}
    result["seconds"] = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "summary.md").write_text(summary_md(result))
    print(summary_md(result))
    kl = [r["kl_nats_mean"] for m in result["models"].values() for r in m["per_question"]]
    print(f"median per-question KL {statistics.median(kl):.4f} nats/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
