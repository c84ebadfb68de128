"""``smcspec distill``: fit the draft to the target (:mod:`smcspec.distill`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from smcspec.cli.engine_args import note


def add_parser(sub) -> None:
    """The ``distill`` subparser."""
    from smcspec.distill.objectives import OBJECTIVES
    from smcspec.distill.run import STAGES, DistillConfig

    d = DistillConfig(out=Path("."))
    p = sub.add_parser(
        "distill",
        help="fit the draft to the target (LoRA, chi-square objective) on the target's answers",
    )
    p.add_argument("--out", required=True, help="the run's folder (resumable)")
    p.add_argument(
        "--target", help="target GGUF file or HF directory (default: the default pair's)"
    )
    p.add_argument(
        "--draft", help="draft to fit: GGUF file or HF directory (default: the default pair's)"
    )
    p.add_argument(
        "--data",
        metavar="FILE",
        help='prompts: one a line, or JSONL {"prompt", "domain"} (default: the built-in '
        "chat/code/math mix)",
    )
    p.add_argument("--teacher", metavar="DIR", help="train on another run's teacher answers")
    p.add_argument("--objective", choices=OBJECTIVES, default=d.objective,
                   help="chi2: Renyi-2 D2(p||q) (default); kl: forward KL; anneal: order 1 to 2; "
                   "reverse-kl: KL(q||p), the baseline")  # fmt: skip
    p.add_argument("--tokens", type=int, default=d.tokens,
                   help=f"training answer tokens (default {d.tokens:,})")  # fmt: skip
    p.add_argument("--stage", choices=STAGES, default=d.stage, help="run one stage (default all)")
    p.add_argument(
        "--temperature",
        type=float,
        default=d.temperature,
        help=f"deployment temperature of the answers and the fit (default {d.temperature})",
    )
    p.add_argument("--max-answer-tokens", type=int, default=d.max_new_tokens, dest="max_answer")
    p.add_argument(
        "--concurrency",
        type=int,
        default=d.concurrency,
        help=f"answers the target decodes together (default {d.concurrency})",
    )
    p.add_argument("--rank", type=int, default=d.rank, help=f"LoRA rank (default {d.rank})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    p.add_argument("--step-tokens", type=int, default=d.step_tokens,
                   help=f"answer tokens per optimizer step (default {d.step_tokens})")  # fmt: skip
    p.add_argument("--validations", type=int, default=d.validations,
                   help="validation passes over the run (default 4, plus one before)")  # fmt: skip
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, help="where training runs: cpu or cuda")
    p.add_argument("--threads", type=int, help="CPU threads (default: the physical cores)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=d.dtype)


def run(args: argparse.Namespace) -> int:
    """Run the stages (:func:`smcspec.distill.run.distill`)."""
    from smcspec.distill.run import DistillConfig, distill

    cfg = DistillConfig(
        out=Path(args.out),
        target=args.target,
        draft=args.draft,
        data=args.data,
        teacher=Path(args.teacher) if args.teacher else None,
        objective=args.objective,
        tokens=args.tokens,
        stage=args.stage,
        temperature=args.temperature,
        max_new_tokens=args.max_answer,
        concurrency=args.concurrency,
        rank=args.rank,
        lr=args.lr,
        step_tokens=args.step_tokens,
        validations=args.validations,
        seed=args.seed,
        device=args.device,
        threads=args.threads,
        dtype=args.dtype,
    )
    out = distill(cfg, note)
    if out is not None:
        print(f"fitted draft: {out}  (use it with --draft {out})")
    return 0
