"""What keeping only the target's top-k tokens does to each distillation objective (issue 84).

``smcspec distill`` keeps the target's next-token distribution as its k most likely tokens
plus the rest mass (:mod:`smcspec.distill.teacher`), and scores the draft on k + 1 buckets
(:func:`smcspec.distill.objectives.bucket_logprobs`), a lower bound of each divergence. This
script measures the gap on a sample of teacher answers: the target's full distribution at
every answer position is recomputed (one llama.cpp prefill of prompt + answer, every
position's logits, at the teacher's temperature) and each divergence between it and the base
draft (transformers, float32) is computed over the whole vocabulary and over the buckets of
that recomputed distribution's own top k (the truncation alone), and over the buckets of the
stored top k (what training sees: the truncation and the difference between llama.cpp's
one-token decodes, which made the answers, and its batched prefill, which recomputes them).

Usage:
  nice .venv/bin/python benchmarks/distill_truncation.py --teacher RUN --records 12 \\
      --out docs/benchmarks/distill/truncation.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from smcspec.distill import objectives as obj
from smcspec.distill.run import DistillConfig
from smcspec.distill.teacher import read_records
from smcspec.distill.training import draft_logprobs, draft_source, hf_dir_of, load_lora_model
from smcspec.models import load_model
from smcspec.models.default_pair import DEFAULT_TARGET, ensure_packaged_model
from smcspec.models.loading import cache_root

FIGURES = {"d2": obj.d2, "kl": obj.kl, "reverse_kl": obj.reverse_kl, "tv": obj.tv}


def target_logprobs(model, record, temperature: float) -> torch.Tensor:
    """float32 ``[L, V]``: the target's tempered log-probabilities at the answer positions."""
    ids = torch.tensor(record.prompt_ids + record.ids[:-1])
    cache = model.new_cache(1, 8)
    logits = model.prefill(ids, cache, 0, len(ids), all_logits=True)
    cache.close()
    rows = logits[len(record.prompt_ids) - 1 :].float()
    return torch.log_softmax(rows / temperature, dim=-1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", required=True, help="a distill run folder with teacher.jsonl")
    ap.add_argument("--records", type=int, default=4, help="validation answers a domain")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    teacher = Path(args.teacher)
    meta = json.loads((teacher / "teacher.json").read_text())
    temperature = meta["temperature"]
    val = [r for r in read_records(teacher) if r.split == "val"]
    records = []
    for d in sorted({r.domain for r in val}):
        records += [r for r in val if r.domain == d][: args.records]
    target = load_model(ensure_packaged_model(DEFAULT_TARGET, cache_root()), backend="llamacpp",
                        sha256=DEFAULT_TARGET.sha256, tokenizer=False).model  # fmt: skip
    path, sha = draft_source(DistillConfig(out=teacher))
    draft = load_lora_model(hf_dir_of(path, sha), 8, 16.0, 0)  # B = 0: the base draft
    draft.eval()
    rows, agree = [], []
    for r in records:
        lp_full = target_logprobs(target, r, temperature)
        with torch.no_grad():
            lq_full = draft_logprobs(draft, r, temperature, "cpu")
        top_ids = torch.tensor(r.top_ids)
        top_lp = torch.tensor(r.top_logprobs)
        agree.append(float((lp_full.gather(-1, top_ids) - top_lp).abs().max()))
        stored = obj.bucket_logprobs(top_ids, top_lp, lq_full)
        own_lp, own_ids = lp_full.topk(top_ids.shape[-1], dim=-1)
        own = obj.bucket_logprobs(own_ids, own_lp, lq_full)
        row = {"id": r.id, "domain": r.domain, "positions": len(r.ids)}
        for name, f in FIGURES.items():
            row[f"{name}_full"] = float(f(lp_full, lq_full).double().mean())
            row[f"{name}_topk"] = float(f(*own).double().mean())
            row[f"{name}_stored"] = float(f(*stored).double().mean())
        row["rest_mass_mean"] = float((1 - top_lp.exp().sum(-1)).clamp_min(0).mean())
        rows.append(row)
        print(json.dumps(row), flush=True)
    total = sum(r["positions"] for r in rows)
    summary = {"records": len(rows), "positions": total, "k": meta["top_k"],
               "temperature": temperature,
               "max_abs_diff_stored_vs_recomputed_logprob": max(agree)}  # fmt: skip
    for name in FIGURES:
        mean = {
            kind: sum(r[f"{name}_{kind}"] * r["positions"] for r in rows) / total
            for kind in ("full", "topk", "stored")
        }
        summary[name] = {**mean, "truncation_gap": (mean["full"] - mean["topk"]) / mean["full"],
                         "stored_gap": (mean["full"] - mean["stored"]) / mean["full"]}  # fmt: skip
    summary["median_rest_mass"] = statistics.median(r["rest_mass_mean"] for r in rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
