"""Where an ``sd`` request's time goes: ``cProfile`` of one request on the first HumanEval
rewrite prompt (llamacpp backend, 2 threads, K = 4, 96 tokens, T = 0.7), after a warm run.

Usage:
  python benchmarks/studies/profile_sd.py model    # sd with the draft model
  python benchmarks/studies/profile_sd.py ngram    # sd with n-gram drafts
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

from smcspec import Engine, GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from ngram_drafts import prompts as rewrite_prompts  # noqa: E402


def main() -> None:
    draft = sys.argv[1] if len(sys.argv) > 1 else "model"
    engine = Engine.load(backend="llamacpp", threads=2)
    messages = [{"role": "user", "content": rewrite_prompts(1)[0]}]
    text = engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    cfg = GenerationConfig(
        method="sd", draft=draft, draft_tokens=4, max_new_tokens=96, temperature=0.7,
        seed=0, ignore_eos=True,
    )  # fmt: skip
    engine.generate(text, cfg, chat=False)  # warm
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    r = engine.generate(text, cfg, chat=False)
    prof.disable()
    print(f"{time.perf_counter() - t0:.2f} s, stats {r.stats}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
