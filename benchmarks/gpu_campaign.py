"""The GPU campaign's measurements: ar, SMC-SD and sd at real model shapes with random weights.

No weights can reach the GPU machines this project is lent (no network, 64 MiB per call), so
the models are built where they run, with the real architectures and random weights
(N(0, 0.02^2) matrices and embeddings, unit norms):

  qwen    Qwen2.5-1.5B target, Qwen2.5-0.5B draft (the default pair's shapes)
  llama   Llama-3.1-8B target, Llama-3.2-1B draft (the SMC-SD paper's smaller pair)

on the torch backend (bfloat16 on a GPU, float32 on a CPU) and on the llamacpp backend (a GGUF
file written with the ``gguf`` package: F16 on a GPU, F32 on a CPU; every layer offloaded
when llama.cpp sees a GPU). A synthetic word-level tokenizer of the real vocabulary size
stands in for the real one (prompts are token ids; EOS is ignored, so every run does the
same work).

With random weights SMC-SD's speed is its real speed (nothing is rejected; resampling
follows the weights, which random models make near uniform). ``sd``'s speed depends on
acceptance: it is measured with the draft equal to the target (acceptance 1, an upper
bound) and labelled so.

Per backend and pair, in one process, alternating the systems run by run (the order
rotates): ``ar`` and SMC-SD at N in {4, 8, 16} x K in {2, 4, 8} at batch 1 (one request),
``sd`` K in {4, 8} with draft = target, then ``ar`` and SMC-SD N=8 K=8 with 8 and 32
concurrent requests through the continuous-batching scheduler. Reported: median tokens/s
(new tokens over wall time, prefill included; for batches, all requests' tokens over the
batch's wall time), the ratio to ``ar`` at the same batch, and beside it the roofline
prediction from measured forward costs (:mod:`smcspec.eval.roofline`).

Rows go to ``results.jsonl`` as they are measured (a run cut short keeps what it had);
``report.md`` and ``tokens_per_s.png`` are written at the end. ``--deadline-s`` skips what
would start after that many seconds, and says so in the report.

Usage (what ``scripts/gpu_campaign.sh`` runs):
  python benchmarks/gpu_campaign.py --device cuda --out OUT --backends torch,llamacpp
  python benchmarks/gpu_campaign.py --device cpu --tiny --out OUT   # the CI rehearsal
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import campaign_kernels
import llama_speculative_gpu
import torch

from smcspec import Engine, GenerationConfig
from smcspec.backends.base import LoadedModel
from smcspec.backends.torch.architecture import ModelConfig
from smcspec.backends.torch.fp8 import convert_to_fp8
from smcspec.backends.torch.kernels import KERNEL_SETS
from smcspec.backends.torch.transformer import Transformer
from smcspec.backends.torch.weights import empty_model
from smcspec.decoding.registry import decoder_named
from smcspec.eval.roofline import (
    batch_bound,
    physics_bound,
    predicted_speedup,
    smc_forward_costs,
    static_forward_costs,
    weight_bytes_read,
    weight_params,
)
from smcspec.scheduler import BatchScheduler, Request
from smcspec.tuning.cache import cpu_model

STD = 0.02  # the Hugging Face initializer_range of both families
SMC = decoder_named("smc")  # the decoder the roofline prices


@dataclass(frozen=True)
class Shape:
    """One model's architecture: what :class:`ModelConfig` needs."""

    name: str
    family: str  # "qwen2" | "llama"
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    tied: bool

    def config(self) -> ModelConfig:
        return ModelConfig(
            model_type=self.family,
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_layers=self.layers,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            rms_norm_eps=1e-6,
            max_position_embeddings=32768,
            qkv_bias=self.family == "qwen2",
            tie_word_embeddings=self.tied,
        )

    def parameters(self) -> int:
        """Parameter count (what the model card states: embeddings counted once if tied)."""
        return sum(math.prod(dims) for _, dims in gguf_tensors(self))


# the published configs (config.json of each Hugging Face repository)
PAIRS = {
    "qwen": (
        Shape("qwen2.5-1.5b", "qwen2", 151936, 1536, 8960, 28, 12, 2, 128, 1e6, True),
        Shape("qwen2.5-0.5b", "qwen2", 151936, 896, 4864, 24, 14, 2, 64, 1e6, True),
    ),
    "llama": (
        Shape("llama-3.1-8b", "llama", 128256, 4096, 14336, 32, 32, 8, 128, 5e5, False),
        Shape("llama-3.2-1b", "llama", 128256, 2048, 8192, 16, 32, 8, 64, 5e5, True),
    ),
    # bf16: 65.5 GB, one H200 holds it
    "qwen32": (
        Shape("qwen2.5-32b", "qwen2", 152064, 5120, 27648, 64, 40, 8, 128, 1e6, False),
        Shape("qwen2.5-0.5b", "qwen2", 151936, 896, 4864, 24, 14, 2, 64, 1e6, True),
    ),
    # the paper's regime; bf16: 141.1 GB of weights, 131.4 GiB of the H200's 140 GiB
    "llama70": (
        Shape("llama-3.1-70b", "llama", 128256, 8192, 28672, 80, 64, 8, 128, 5e5, False),
        Shape("llama-3.2-1b", "llama", 128256, 2048, 8192, 16, 32, 8, 64, 5e5, True),
    ),
}
TORCH_ONLY = {"qwen32", "llama70"}  # pairs never written as GGUF (too large to write here)
# the same families, tiny (the CPU rehearsal: the whole sequence in a minute)
TINY = {
    "llama70": (
        Shape("tiny-llama-70-target", "llama", 512, 96, 192, 3, 6, 2, 16, 5e5, False),
        Shape("tiny-llama-70-draft", "llama", 512, 32, 64, 1, 2, 1, 16, 5e5, True),
    ),
    "qwen32": (
        Shape("tiny-qwen2-32-target", "qwen2", 520, 64, 128, 3, 4, 2, 16, 1e6, False),
        Shape("tiny-qwen2-32-draft", "qwen2", 512, 32, 64, 1, 2, 1, 16, 1e6, True),
    ),
    "qwen": (
        Shape("tiny-qwen2-target", "qwen2", 512, 64, 128, 2, 4, 2, 16, 1e6, True),
        Shape("tiny-qwen2-draft", "qwen2", 512, 32, 64, 1, 2, 1, 16, 1e6, True),
    ),
    "llama": (
        Shape("tiny-llama-target", "llama", 512, 64, 128, 2, 4, 2, 16, 5e5, False),
        Shape("tiny-llama-draft", "llama", 512, 32, 64, 1, 2, 1, 16, 5e5, True),
    ),
}


def synthetic_tokenizer(vocab: int):
    """A word-level ``PreTrainedTokenizerFast`` of exactly ``vocab`` tokens ``t0 ... t{V-1}``
    (eos = the last); what the engine needs of a tokenizer when prompts are token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = token_texts(vocab)
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=words[-1], pad_token=words[-1], unk_token=words[0]
    )


def token_texts(vocab: int) -> list[str]:
    """The synthetic vocabulary: ``a``, ``b``, ``ab`` (one BPE merge, which llama.cpp's BPE
    loader needs), then ``t3 ... t{V-2}`` and the eos ``</s>``."""
    return ["a", "b", "ab", *(f"t{i}" for i in range(3, vocab - 1)), "</s>"]


def _fill(t: torch.Tensor, name: str, gen: torch.Generator) -> None:
    if "norm" in name:
        t.fill_(1.0)
    else:
        t.normal_(0.0, STD, generator=gen)


def torch_model(shape: Shape, device: str, dtype: torch.dtype, seed: int) -> Transformer:
    """Our transformer of ``shape`` with random weights on ``device`` (built there, no copy)."""
    model = empty_model(shape.config(), dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            _fill(p, name, gen)
    return model.eval()


GGUF_NAMES = {
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_output",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "down": "ffn_down",
    "attn_norm": "attn_norm",
    "mlp_norm": "ffn_norm",
}


def gguf_tensors(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """The llama.cpp tensor names and shapes (``[rows, cols]`` as numpy holds them) of
    ``shape``, as ``convert_hf_to_gguf.py`` writes a Llama or Qwen2 checkpoint."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = [("token_embd.weight", (shape.vocab, h)), ("output_norm.weight", (h,))]
    if not shape.tied:
        out.append(("output.weight", (shape.vocab, h)))
    for i in range(shape.layers):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (h,)),
            (b + "attn_q.weight", (q, h)),
            (b + "attn_k.weight", (kv, h)),
            (b + "attn_v.weight", (kv, h)),
            (b + "attn_output.weight", (h, q)),
            (b + "ffn_norm.weight", (h,)),
            (b + "ffn_gate.weight", (shape.intermediate, h)),
            (b + "ffn_up.weight", (shape.intermediate, h)),
            (b + "ffn_down.weight", (h, shape.intermediate)),
        ]
        if shape.family == "qwen2":
            out += [(b + f"attn_{x}.bias", (n,)) for x, n in (("q", q), ("k", kv), ("v", kv))]
    return out


def write_gguf(shape: Shape, path: Path, half: bool, seed: int) -> Path:
    """Write ``shape`` with random weights as a GGUF file (F16 matrices with ``half``, else
    F32; norms and biases F32) with the synthetic vocabulary's tokenizer metadata. Random
    numbers come from torch on the GPU when there is one (fast), else the CPU."""
    import gguf
    import numpy as np

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(seed)
    w = gguf.GGUFWriter(str(path), shape.family)
    w.add_name(shape.name)
    w.add_block_count(shape.layers)
    w.add_context_length(32768)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if half else gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if shape.family == "qwen2" else "llama-bpe")
    w.add_token_list(token_texts(shape.vocab))
    w.add_token_types([gguf.TokenType.NORMAL] * (shape.vocab - 1) + [gguf.TokenType.CONTROL])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(shape.vocab - 1)
    w.add_bos_token_id(shape.vocab - 1)
    w.add_add_bos_token(False)
    for name, dims in gguf_tensors(shape):
        dt = torch.float16 if half and len(dims) == 2 else torch.float32
        t = torch.empty(dims, device=dev, dtype=dt)
        _fill(t, name, gen)
        w.add_tensor(name, np.ascontiguousarray(t.cpu().numpy()))
        del t
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------------------- the pair
def load_pair(
    backend: str,
    pair: tuple[Shape, Shape],
    args,
    workdir: Path,
    upper_bound: bool,
    reuse: bool = False,
):
    """(target, draft, target copy as a draft) LoadedModels on ``backend``; the copy (same
    weights) is the draft of the acceptance-1 ``sd`` upper bound. ``reuse``: GGUF files
    already in ``workdir`` are loaded as they are, not written again."""
    target_shape, draft_shape = pair
    tok = synthetic_tokenizer(target_shape.vocab)
    gpu = args.device == "cuda"

    def wrap(model, shape: Shape, path: Path) -> LoadedModel:
        return LoadedModel(
            model=model,
            tokenizer=tok,
            path=path,
            config=None,
            name=shape.name,
            backend=backend,
            vocab_size=shape.vocab,
            context_length=32768,
        )

    if backend == "torch":
        dtype = torch.bfloat16 if gpu else torch.float32
        # FP8: the projections only (smcspec.backends.torch.fp8); the target converted before
        # the draft is made (70B: 131.4 GiB in bf16 leaves too little beside a bf16 draft)
        t = torch_model(target_shape, args.device, dtype, seed=1)
        if args.weights == "fp8":
            convert_to_fp8(t)
        d = torch_model(draft_shape, args.device, dtype, seed=2)
        if args.weights == "fp8":
            convert_to_fp8(d)
        return (
            wrap(t, target_shape, workdir),
            wrap(d, draft_shape, workdir),
            wrap(t, target_shape, workdir),
        )
    from smcspec.backends.llamacpp import LlamaCppModel, LlamaCppSettings

    settings = LlamaCppSettings(
        threads=args.threads,
        kv_cells=args.kv_cells,
        max_sequences=256,
        n_batch=2048,
        gpu_layers=-1 if gpu else 0,
        logits_device=args.logits_device or args.device,
    )
    files = [workdir / f"{s.name}.gguf" for s in pair]
    for i, (s, f) in enumerate(zip(pair, files, strict=True)):
        if not (reuse and f.exists()):
            write_gguf(s, f, half=gpu, seed=i + 1)
    t = LlamaCppModel(files[0], settings)
    d = LlamaCppModel(files[1], settings)
    copy = LlamaCppModel(files[0], settings) if upper_bound else None
    return (
        wrap(t, target_shape, files[0]),
        wrap(d, draft_shape, files[1]),
        wrap(copy, target_shape, files[0]) if copy is not None else None,
    )


# ------------------------------------------------------------------------------ runs
@dataclass(frozen=True)
class System:
    """One measured configuration: ``method`` at (N, K), ``batch`` concurrent requests."""

    method: str
    n: int = 1
    k: int = 0
    batch: int = 1
    upper_bound: bool = False  # sd with draft = target
    rounds: str = "auto"  # the torch models' round mode (ROUND_MODES): auto = graphs on CUDA
    kernels: str = "auto"  # torch: the layers' kernel set (KERNEL_MODES): auto = flex on CUDA
    round_end: str = "block"  # smc: where a round ends (block, or ess: cut where the ESS falls)

    @property
    def label(self) -> str:
        if self.method == "ar":
            name = "ar"
        elif self.method == "sd":  # N >= 2: multi-draft sd (N chains a round)
            name = f"sd-n{self.n}-k{self.k}" if self.n > 1 else f"sd-k{self.k}"
            name += " (draft=target)" if self.upper_bound else ""
        else:
            name = f"smc-n{self.n}-k{self.k}" + ("-ess" if self.round_end == "ess" else "")
        name = name if self.rounds == "auto" else f"{name} [{self.rounds}]"
        return name if self.kernels == "auto" else f"{name} [{self.kernels}]"


def run_system(engines: dict[str, Engine], system: System, args, rep: int) -> dict:
    """One timed run of ``system``: returns tokens, seconds and tokens/s."""
    engine = engines["copy" if system.upper_bound else "pair"]
    for m in engine.models().values():  # torch models: how rounds run (steps or graphs)
        if hasattr(m, "rounds"):  # auto: graphs, which a CPU runs uncaptured (the rehearsal)
            m.rounds = "graphs" if system.rounds == "auto" else system.rounds
        if hasattr(m, "use_kernels"):  # and with which kernels between the GEMMs
            m.use_kernels(system.kernels)
    cfg = GenerationConfig(
        method=system.method,
        particles=max(system.n, 1),
        draft_tokens=max(system.k, 1),
        round_end=system.round_end,
        max_new_tokens=args.max_new_tokens,
        ignore_eos=True,
        temperature=0.7,
        seed=rep,
    )
    vocab = engine.vocab
    prompts = [
        [(1000 + 7919 * (i + 13 * r) + 31 * j) % (vocab - 1) for j in range(args.prompt_tokens)]
        for i, r in enumerate([rep] * system.batch)
    ]
    if system.batch == 1:
        r = engine.generate(prompts[0], cfg)
        out = {"tokens": r.new_tokens, "seconds": r.seconds, "stats": _small(r.stats)}
    else:
        out = run_batch(engine, prompts, cfg, system.batch)
    return {**out, "kernels": _kernels_run(engines)}


def run_batch(engine: Engine, prompts: list[list[int]], cfg: GenerationConfig, b: int) -> dict:
    """``b`` requests submitted at once to a :class:`BatchScheduler` (continuous batching);
    tokens/s is all their new tokens over the wall time from the first submit to the last
    result. ``joined_calls``/``joined_rounds``: the target's batched calls over a bank of
    static caches and the requests' rounds they ran (rounds not counted ran alone)."""
    done, results, lock = threading.Event(), [], threading.Lock()
    target = engine.target.model
    joined0 = getattr(target, "joined_calls", 0), getattr(target, "joined_rounds", 0)

    def on_done(outcome) -> None:
        with lock:
            results.append(outcome)
            if len(results) == len(prompts):
                done.set()

    sched = BatchScheduler(engine, max_running=b, max_waiting=b)
    sched.start()
    try:
        jobs = [
            engine.prepare(p, replace(cfg, seed=(cfg.seed or 0) + i)) for i, p in enumerate(prompts)
        ]
        t0 = time.perf_counter()
        for job in jobs:
            sched.submit(Request(job=job, on_done=on_done))
        if not done.wait(timeout=600):
            raise TimeoutError("batch did not finish in 600 s")
        seconds = time.perf_counter() - t0
    finally:
        sched.stop()
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
    joined = {
        "joined_calls": getattr(target, "joined_calls", 0) - joined0[0],
        "joined_rounds": getattr(target, "joined_rounds", 0) - joined0[1],
    }
    return {"tokens": sum(r.new_tokens for r in results), "seconds": seconds, "stats": joined}


def _small(stats: dict) -> dict:
    keep = ("acceptance_rate", "mean_accepted_length", "resamples", "rounds", "mean_ess",
            "ess_min", "mean_round_tokens", "cut_rounds")  # fmt: skip
    return {k: stats[k] for k in keep if k in stats}


BATCH_NK = (8, 8)  # the SMC-SD setting of the batch groups, beside ar


def systems(args, upper_bound: bool, backend: str) -> list[list[System]]:
    """The groups of systems compared side by side (each group alternated run by run): on
    torch with ``--compare-steps`` first ``ar`` and SMC-SD N=8 K=8 with rounds step by step
    and as graphs; with ``--compare-kernels`` ``ar`` and SMC-SD with each kernel set of
    ``--kernel-sets`` (:mod:`smcspec.backends.torch.kernels`: written, compiled small kernels,
    flex attention, whole layers compiled); then the grid (``ar``, SMC-SD at every N x K, the
    acceptance-1 ``sd`` rows); then the batches."""
    groups = []
    if backend == "torch" and args.compare_steps:
        n, k = args.compare_steps
        groups.append(
            [System("ar", rounds="steps"), System("ar"),
             System("smc", n, k, rounds="steps"), System("smc", n, k)]
        )  # fmt: skip
    if backend == "torch" and args.compare_kernels:
        n, k = args.compare_kernels
        groups.append(
            [System("ar", kernels=s) for s in args.kernel_sets]
            + [System("smc", n, k, kernels=s) for s in args.kernel_sets]
        )
    grid = [System("smc", n, k) for n in args.particles for k in args.draft_tokens]
    groups.append([System("ar"), *grid])
    if upper_bound:  # the acceptance-1 sd rows (draft = the target's own weights)
        groups[-1] += [System("sd", 1, k, upper_bound=True) for k in (4, 8)]
    if backend == "torch" and args.compare_frontier:  # issue 74's decoders, side by side
        n, k, sd_k = args.compare_frontier
        groups.append(
            [System("smc", n, k), System("smc", n, k, round_end="ess"),
             System("sd", 1, sd_k), System("sd", n, sd_k)]
        )  # fmt: skip
    for b in args.batches:
        if b == 1:  # the grid above is the batch-1 group: a second one would repeat it
            continue
        groups.append([System("ar", batch=b), System("smc", *BATCH_NK, batch=b)])
    return groups


# ---------------------------------------------------------------------------- driver
class Campaign:
    """Writes rows to ``results.jsonl`` as they come; knows the deadline."""

    def __init__(self, args) -> None:
        self.args, self.t0 = args, time.monotonic()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []
        self.file = open(self.out / "results.jsonl", "a")

    def skip(self, what: str) -> None:
        self.row(kind="skipped", what=what)

    def left(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.t0)

    def row(self, **row) -> None:
        row["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        self.rows.append(row)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        print(json.dumps(row), flush=True)


def measure(c: Campaign, backend: str, pair_name: str) -> None:
    """Load one pair on one backend, write its roofline and bound rows, then time every group
    of :func:`systems`; the models are freed at the end."""
    args = c.args
    pair = (TINY if args.tiny else PAIRS)[pair_name]
    if c.left() < args.min_step_s:
        c.skip(f"{backend}/{pair_name}: out of time before loading")
        return
    workdir = Path(args.workdir) / f"{backend}-{pair_name}"
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    upper = pair_name in args.upper_bound_pairs or backend == "torch"  # torch: no second copy
    target, draft, copy = load_pair(backend, pair, args, workdir, upper)
    fp8 = backend == "torch" and args.weights == "fp8"
    label = fp8_label(pair_name) if fp8 else pair_name  # its rows are compared among themselves
    base = dict(backend=backend, pair=label, target=pair[0].name, draft=pair[1].name)
    c.row(
        kind="load",
        seconds=round(time.perf_counter() - t0, 2),
        target_params=pair[0].parameters(),
        draft_params=pair[1].parameters(),
        # what llama.cpp's CUDA backend saw (smcspec sets it where layers are offloaded)
        ggml_cuda_disable_graphs=os.environ.get("GGML_CUDA_DISABLE_GRAPHS"),
        logits_device=str(target.model.device),
        weights="fp8" if fp8 else "native",
        **base,
    )
    engines = {"pair": Engine(target, draft)}
    if copy is not None:
        engines["copy"] = Engine(target, copy)
    if args.roofline:
        rooflines(c, backend, target.model, draft.model, base)
    if args.pair_stats and backend == "torch":
        tuned(c, engines["pair"], base)
    for i, group in enumerate(systems(args, upper, backend)):
        time_group(c, engines, group, {**base, "group": i})
    if args.profile and backend == "torch" and c.left() > args.min_step_s:
        profile_round(c, engines, base)
    if args.profile_kernels and backend == "torch":
        n, k = args.compare_kernels or (8, 8)
        request = (n, k, args.prompt_tokens, min(64, args.max_new_tokens))
        campaign_kernels.device_profile(c, engines["pair"], base, args.profile_kernels, *request)
    if args.compare_fp8 and backend == "torch" and args.weights != "fp8":
        fp8_group(c, engines, target.model, draft.model, base)  # last: it converts the models
    if args.llama_speculative and backend == "llamacpp" and pair_name == "llama":
        run_llama_speculative(c, target, draft, base)
    for m in {id(x.model): x.model for x in (target, draft, copy) if x is not None}.values():
        release = getattr(m, "release", None) or getattr(m, "release_static", None)
        if release is not None:  # llamacpp: the model; torch: static caches and graphs
            release()
    del engines, target, draft, copy
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rooflines(
    c: Campaign, backend: str, target, draft, base: dict, settings: list | None = None
) -> None:
    """Per (N, K) of ``settings`` (default: the grid): the roofline from measured forward costs
    (``roofline`` rows: the step forwards; on torch also ``roofline-fused``, the static
    forwards fused rounds run, graph replays on CUDA) and the bound from weight bytes over
    ``--bandwidth`` (``bound`` rows)."""
    args = c.args
    fused = backend == "torch"  # on a CPU the fused forwards run uncaptured (the rehearsal)
    grid = [(n, k) for n in args.particles for k in args.draft_tokens]
    for n, k in settings or grid:
        if c.left() < args.min_step_s:
            c.skip(f"{base['backend']}/{base['pair']} roofline n{n} k{k}: out of time")
            return
        for m in (target, draft):  # the step-by-step forwards (eager on torch)
            if hasattr(m, "rounds"):
                m.rounds = "steps"
                m.use_kernels("auto")  # the default kernels, whatever a group ran last
        costs = smc_forward_costs(target, draft, n, k, SMC)
        c.row(kind="roofline", n=n, k=k, costs_s=costs, **predicted_speedup(costs, n, k, SMC),
              **base)  # fmt: skip
        if fused:
            target.rounds = draft.rounds = "graphs"
            costs = static_forward_costs(target, draft, n, k, SMC)
            c.row(kind="roofline-fused", n=n, k=k, costs_s=costs,
                  **predicted_speedup(costs, n, k, SMC), **base)  # fmt: skip
        if backend == "torch":
            tb, db = weight_bytes_read(target), weight_bytes_read(draft)
            c.row(kind="bound", n=n, k=k, target_bytes=tb, draft_bytes=db,
                  bandwidth=args.bandwidth, **physics_bound(tb, db, n, k, args.bandwidth),
                  **base)  # fmt: skip
    if backend == "torch" and settings is None:  # the batch groups' bounds (batch_bound)
        weights = weight_bytes_read(target), weight_bytes_read(draft)
        params = weight_params(target), weight_params(draft)
        for b in (b for b in args.batches if b > 1):
            bound = batch_bound(weights, params, *BATCH_NK, b, args.bandwidth, args.peak_flops)
            c.row(kind="bound-batch", n=BATCH_NK[0], k=BATCH_NK[1], batch=b, weight_bytes=weights,
                  params=params, bandwidth=args.bandwidth, peak_flops=args.peak_flops, **bound,
                  **base)  # fmt: skip


# settings whose answers were measured with real weights (GSM8K, first 100 or all 400 questions:
# docs/benchmarks/gsm8k-400/, docs/benchmarks/gsm8k-gpu-settings/)
QUALITY_MEASURED = ("ar", "smc-n8-k2", "smc-n8-k8", "smc-n2-k16", "smc-n2-k32", "smc-n4-k12")


def tuned(c: Campaign, engine: Engine, base: dict) -> None:
    """The tuner on this device (``smcspec.tuning.tune``): the forward costs measured here
    (the static forwards fused rounds run, graph replays on CUDA), the pair's acceptance
    statistics from ``--pair-stats`` (measured with real weights where they run: random weights
    accept nothing meaningful), the fidelity floor (N >= 4, predicted ESS >= 4). A ``tuned``
    row: the choices of ``auto`` and ``smc``, whether their answers were measured
    (:data:`QUALITY_MEASURED`), and every setting's prediction."""
    from smcspec.tuning import TuningGrid, tune
    from smcspec.tuning.grid import GPU_MAX_FORWARD_TOKENS
    from smcspec.tuning.pair_stats import read_pair_stats

    args = c.args
    if c.left() < args.min_step_s:
        c.skip(f"{base['backend']}/{base['pair']} tuner: out of time")
        return
    for m in engine.models().values():
        if hasattr(m, "rounds"):
            m.rounds = "auto"
            m.use_kernels("auto")
    grid = TuningGrid(
        draft_tokens=tuple(args.tune_draft_tokens), max_forward_tokens=GPU_MAX_FORWARD_TOKENS
    )
    os.environ["SMCSPEC_CACHE"] = str(Path(args.workdir) / "tuner-cache")  # not the user's
    t0 = time.perf_counter()
    tuning = tune(
        engine, GenerationConfig(temperature=0.7), grid=grid, remeasure=True,
        pair_stats=read_pair_stats(args.pair_stats),
    )  # fmt: skip

    def pick(p) -> dict:
        name = p.setting.name
        return {"setting": name, "tokens_per_s": p.tokens_per_second, "ess": p.ess,
                "quality_measured": name in QUALITY_MEASURED}  # fmt: skip

    picks = {c.name: pick(p) for c, p in tuning.picks.items()}  # by the choice's name
    c.row(
        kind="tuned",
        seconds=round(time.perf_counter() - t0, 1),
        auto=picks["auto"],
        smc=picks.get("smc"),  # None without a draft model
        min_particles=tuning.min_particles,
        min_ess=tuning.min_ess,
        alpha=tuning.acceptance["alpha"],
        acceptance_source=tuning.acceptance_source,
        predictions=[pick(p) for p in tuning.predictions if not p.setting.ngram],
        **base,
    )


def run_llama_speculative(c: Campaign, target, draft, base: dict) -> None:
    """llama.cpp's ``llama-speculative`` on this pair's GGUF files
    (:mod:`llama_speculative_gpu`), its speed predicted at ``--pair-stats``' alpha; a
    ``skipped`` row where the binary was not built."""
    binary = Path(c.args.llama_speculative)
    if not binary.is_file():
        c.skip(f"llamacpp/{base['pair']} llama-speculative: {binary} was not built")
        return
    alpha = None
    if c.args.pair_stats:
        from smcspec.config import GenerationConfig
        from smcspec.tuning.cache import sampling_key
        from smcspec.tuning.pair_stats import read_pair_stats

        t07 = sampling_key(GenerationConfig(temperature=0.7, draft_temperature=0.7))
        acc = read_pair_stats(c.args.pair_stats).for_sampling(t07)
        alpha = acc["alpha"]
    llama_speculative_gpu.measure(c, binary, target.path, draft.path, base, alpha)


def fp8_label(pair: str) -> str:
    """The pair label of rows measured with FP8 projections (``PAIR-fp8``)."""
    return f"{pair}-fp8"


def fp8_group(c: Campaign, engines: dict[str, Engine], target, draft, base: dict) -> None:
    """``--compare-fp8 N,K``: the pair's projections converted to FP8 in place
    (:func:`~smcspec.backends.torch.fp8.convert_to_fp8`; nothing runs on the bf16 models after
    it), then the roofline and bound of N, K and a group of ``ar`` and SMC-SD N, K, under the
    pair label ``PAIR-fp8`` (an ``fp8`` row: the seconds and bytes the conversion took and
    saved)."""
    args = c.args
    if c.left() < args.min_step_s:
        c.skip(f"{base['backend']}/{base['pair']} FP8 group: out of time")
        return
    t0 = time.perf_counter()
    saved = convert_to_fp8(target) + convert_to_fp8(draft)
    fp8 = {**base, "pair": fp8_label(base["pair"])}
    c.row(kind="fp8", seconds=round(time.perf_counter() - t0, 2), bytes_saved=saved, **fp8)
    n, k = args.compare_fp8
    if args.roofline:
        rooflines(c, "torch", target, draft, fp8, [(n, k)])
    time_group(c, engines, [System("ar"), System("smc", n, k)], {**fp8, "group": 0})


def profile_round(c: Campaign, engines: dict[str, Engine], base: dict) -> None:
    """One SMC-SD request (N, K of ``--compare-steps``, else 8, 8) under cProfile: where the
    wall time of a graph-run request goes (replays are asynchronous: the device's time shows
    up where the host first waits for a round's outputs, ``check_ok``). A ``profile`` row
    with the 25 functions of largest total time and the request's wall seconds."""
    import cProfile
    import io
    import pstats

    n, k = c.args.compare_steps or (8, 8)
    system = System("smc", n, k)
    run_system(engines, system, c.args, 0)  # graphs captured before the profile
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    run_system(engines, system, c.args, 1)
    prof.disable()
    wall = time.perf_counter() - t0
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    c.row(kind="profile", system=system.label, wall_s=wall, top=text.getvalue()[-6000:], **base)


def time_group(c: Campaign, engines: dict[str, Engine], group: list[System], base: dict) -> None:
    """Warm every system of ``group`` up (graphs captured at the full length), then run them
    alternated ``--reps`` times and write a ``run`` row for each; a system that fails gets an
    ``error`` row and leaves the group, the others go on."""
    args = c.args
    short = argparse.Namespace(**{**vars(args), "max_new_tokens": min(16, args.max_new_tokens)})
    live = []
    for s in group:  # warm-up (kernels, caches, graphs), not recorded
        try:
            run_system(engines, s, args if s.rounds != "steps" else short, 0)
            live.append(s)
        except Exception as exc:
            c.row(kind="error", system=s.label, error=repr(exc)[:2000], **base)
    times: dict[System, list[dict]] = {s: [] for s in live}
    for rep in range(args.reps):
        if c.left() < args.min_step_s:
            c.skip(f"{base['backend']}/{base['pair']} {group[-1].label} batch "
                   f"{group[0].batch}: out of time after {rep} reps")  # fmt: skip
            break
        order = live[rep % len(live) :] + live[: rep % len(live)] if live else []
        for s in order:
            if s not in times:
                continue
            try:
                times[s].append(run_system(engines, s, args, rep + 1))
            except Exception as exc:
                c.row(kind="error", system=s.label, error=repr(exc)[:2000], **base)
                del times[s]
    for s, runs in times.items():
        if not runs:
            continue
        tps = [r["tokens"] / r["seconds"] for r in runs]
        c.row(
            kind="run",
            system=s.label,
            method=s.method,
            n=s.n,
            k=s.k,
            batch=s.batch,
            upper_bound=s.upper_bound,
            rounds=s.rounds,
            round_end=s.round_end,
            kernel_mode=s.kernels,
            kernels=runs[-1].get("kernels"),
            reps=len(runs),
            tokens_per_s=statistics.median(tps),
            all_tokens_per_s=tps,
            tokens=runs[0]["tokens"],
            stats=runs[-1].get("stats", {}),
            **base,
        )


def environment(args) -> dict:
    """What ran: device, driver, CUDA, torch, llama.cpp, CPU, host."""
    env = {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "device": args.device,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "tiny": args.tiny,
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(
            gpu=p.name,
            gpu_memory_gib=round(p.total_memory / 2**30, 1),
            multiprocessors=p.multi_processor_count,
        )
        try:
            env["nvidia_smi"] = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,compute_cap,clocks.max.sm",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            env["nvidia_smi"] = f"unavailable: {exc}"
    try:
        import llama_cpp

        env["llama_cpp"] = f"{llama_cpp.__version__} ({Path(llama_cpp.__file__).parent})"
        from smcspec.backends.llamacpp.rpc import gpu_devices

        env["llama_cpp_gpus"] = gpu_devices()
        env["llama_cpp_ok"] = True
    except Exception as exc:  # absent or not built: reported, the torch rows still run
        env["llama_cpp"] = f"unavailable: {exc!r}"
        env["llama_cpp_ok"] = False
    return env


def report(c: Campaign, env: dict, argv: list[str]) -> None:
    """``report.md`` (tables, roofline beside each figure) and ``tokens_per_s.png``, from
    every row of ``results.jsonl`` (the script's two phases append to one file)."""
    with open(c.out / "results.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    envs = [r for r in rows if r["kind"] == "environment"] or [env]
    env = {k: v for k, v in envs[-1].items() if k not in ("kind", "elapsed_s", "command")}
    # A phase is one call of the script (its rows follow its ``environment`` row): a ratio
    # takes the ``ar`` and the roofline measured in its own phase, on its own machine.
    phase = 0
    for r in rows:
        phase += r["kind"] == "environment"
        r["phase"] = phase
    runs = [r for r in rows if r["kind"] == "run"]
    for r in runs:  # rows of earlier campaigns have neither
        r.setdefault("rounds", "auto")
        r.setdefault("group", 0)
    roof = {
        (r["kind"], r["phase"], r["backend"], r["pair"], r["n"], r["k"]): r
        for r in rows
        if r["kind"] in ("roofline", "roofline-fused", "bound")
    }
    roof |= {
        ("bound-batch", r["phase"], r["backend"], r["pair"], r["batch"]): r
        for r in rows
        if r["kind"] == "bound-batch"
    }
    ar = {_ar_key(r): r["tokens_per_s"] for r in runs if r["method"] == "ar"}
    lines = [
        "# GPU campaign report" + (" (CPU rehearsal, tiny shapes)" if env["tiny"] else ""),
        "",
        "Commands (one per phase, each from the repository root):",
        "",
        *(f"- `{r.get('command', ' '.join(argv))}` ({r.get('date_utc', '')} UTC)" for r in envs),
        "",
        "| | |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in env.items()),
        "",
        "Random weights at the named shapes; prompts of token ids, EOS ignored, T = 0.7 (the "
        "prompt length and new tokens per request are in each command; `new` below is the new "
        "tokens per request); median of the runs listed, systems alternated run by run within "
        "a group. tokens/s = new tokens / wall seconds (prefill included; a batch: all its "
        "requests' tokens / its wall time). torch rows run their rounds as CUDA graphs "
        "(each decoder's `decoding/*/fused.py`; on a CPU the same functions uncaptured) "
        "unless marked `[steps]` (one forward at a time, sampling on the "
        "host between). `x ar`: ratio to the `ar` of the same group, rounds mode and batch, "
        "measured by the same command. Roofline: the speed-up predicted from measured forward "
        "costs ((K+1) target 1x1 forwards over one round's K draft forwards + one target "
        "forward of N(K+1) tokens; for graph rows the forwards are graph replays, "
        "`smcspec.eval.roofline.static_forward_costs`) and the memory-bound bound "
        "(K+1)/((K+1)c+1). `bound`: tokens/s if every forward only read its weights at the "
        "command's bandwidth (ar: one target read a token; SMC-SD: K draft reads and one "
        "target read for K+1 tokens; a batch of B requests: per forward the longer of one read "
        "of its weights and 2 FLOPs per parameter per row at the command's peak FLOP/s, ar's "
        "forward B rows, SMC-SD's K draft forwards B*N rows and its target forward "
        "B*N*(K+1), `smcspec.eval.roofline.batch_bound`). `sd (draft=target)` has acceptance "
        "1: an upper bound on "
        "sd, not a real pair.",
        "",
    ]
    for backend, pair in dict.fromkeys((r["backend"], r["pair"]) for r in runs):
        sel = [r for r in runs if (r["backend"], r["pair"]) == (backend, pair)]
        several = len({r["phase"] for r in sel}) > 1
        lines += [
            f"## {backend}: {sel[0]['target']} / {sel[0]['draft']}"
            + (" with FP8 projections" if pair.endswith(fp8_label("")) else ""),
            "",
            "| system | batch | new | tokens/s | x ar | roofline (measured costs) | "
            "memory-bound | bound tokens/s | of bound | runs |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        lines += [_report_line(r, ar, roof, several) for r in sel]
        lines.append("")
    for r in (r for r in rows if r["kind"] == "tuned"):
        lines += _tuned_lines(r)
    lines += campaign_kernels.prediction_lines(rows, env["tiny"])
    ar_batch1 = {(r["phase"], r["backend"], r["pair"]): r["tokens_per_s"] for r in runs
                 if r["method"] == "ar" and r["batch"] == 1 and r["rounds"] == "auto"}  # fmt: skip
    lines += llama_speculative_gpu.report_lines(rows, ar_batch1)
    loads = [r for r in rows if r["kind"] == "load"]
    if loads:
        lines += [
            "Model build and load: "
            + "; ".join(f"{r['backend']} {r['pair']} {r['seconds']:.0f} s" for r in loads)
            + ".",
            "",
        ]
    skipped = [r["what"] for r in rows if r["kind"] == "skipped"]
    if skipped:
        lines += ["## Not measured", "", *(f"- {s}" for s in skipped), ""]
    (c.out / "report.md").write_text("\n".join(lines))
    if runs:
        plot(runs, ar, c.out / "tokens_per_s.png")


def _tuned_lines(r: dict) -> list[str]:
    """The report's section on a ``tuned`` row: the choices, then the fastest predictions."""

    def answers(p: dict) -> str:
        return "GSM8K measured" if p["quality_measured"] else "not measured"

    def choice(name: str, p: dict | None) -> str:
        if p is None:
            return f"- `{name}`: none (no draft)"
        ess = f", predicted ESS {p['ess']:.2f}" if p["ess"] is not None else ""
        if "ngram" in p["setting"]:  # synthetic prompts: n-gram drafts find nothing to copy
            ess = " at its gate's threshold (where text copies; prompts here are random ids)"
        return f"- `{name}` chooses {p['setting']}: {p['tokens_per_s']:.1f} tokens/s{ess}; " + (
            "its answers are measured" if p["quality_measured"] else "its answers are not measured"
        )

    best = sorted(r["predictions"], key=lambda p: -p["tokens_per_s"])[:12]
    return [
        f"## The tuner on this device: {r['backend']}, {r['target']} / {r['draft']}",
        "",
        f"Forward costs measured here in {r['seconds']:.0f} s (graph captures included); "
        f"acceptance statistics (alpha {r['alpha']:.3f}, log-weights, agreement profiles) from "
        f"{r['acceptance_source']}: the real pair's, standing in for this pair's (random weights "
        f"accept nothing meaningful); fidelity floor N >= {r['min_particles']}, predicted ESS "
        f">= {r['min_ess']:g}. Predicted speeds count the forwards only. Answers measured: "
        "docs/benchmarks/gsm8k-400/ and docs/benchmarks/gsm8k-gpu-settings/.",
        "",
        choice("auto", r["auto"]),
        choice("smc", r["smc"]),
        "",
        "| setting (fastest 12) | predicted tokens/s | predicted ESS after a round | answers |",
        "| --- | ---: | ---: | --- |",
        *(
            f"| {p['setting']} | {p['tokens_per_s']:.1f} | "
            f"{'-' if p['ess'] is None else format(p['ess'], '.2f')} | {answers(p)} |"
            for p in best
        ),
        "",
    ]


def _kernels_run(engines: dict[str, Engine]) -> str | None:
    """The kernel set the pair's target ran (``auto`` resolved); None off torch."""
    kernels = getattr(engines["pair"].target.model, "kernels", None)
    return getattr(kernels, "name", None)


def _ar_key(r: dict) -> tuple:
    keys = ("phase", "backend", "pair", "group", "batch", "rounds")
    mode = r.get("kernel_mode", "compiled" if r.get("compiled") else "auto")  # older rows
    return (*(r[k] for k in keys), mode)


def _report_line(r: dict, ar: dict, roof: dict, several: bool) -> str:
    """One table row: tokens/s, the ratio to its ``ar``, roofline and bound beside it."""
    base = ar.get(_ar_key(r))
    ratio = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
    key = (r["phase"], r["backend"], r["pair"], r["n"], r["k"])
    kind = "roofline-fused" if r["backend"] == "torch" and r["rounds"] != "steps" else "roofline"
    rf = None
    if r["method"] == "smc" and r["batch"] == 1:  # rows of older campaigns: no fused roofline
        rf = roof.get((kind, *key)) or roof.get(("roofline", *key))
    pred = f"{rf['measured_costs']:.2f}" if rf else "-"
    mb = f"{rf['memory_bound']:.2f}" if rf else "-"
    tps = None
    if r["batch"] == 1 and r["method"] == "smc":
        tps = roof.get(("bound", *key), {}).get("smc_bound_tps")
    elif r["batch"] == 1 and r["method"] == "ar":  # the same for every (N, K) of the pair
        pair_bounds = [
            b for (kd, *k), b in roof.items() if kd == "bound" and tuple(k[:3]) == key[:3]
        ]
        tps = pair_bounds[0]["ar_bound_tps"] if pair_bounds else None
    elif r["batch"] > 1:  # weights or compute, the longer, per forward (batch_bound)
        bb = roof.get(("bound-batch", *key[:3], r["batch"]))
        if bb and r["method"] == "ar":
            tps = bb["ar_bound_tps"]
        elif bb and (r["n"], r["k"]) == (bb["n"], bb["k"]):
            tps = bb["smc_bound_tps"]
    b_txt = f"{tps:.0f}" if tps else "-"
    share = f"{r['tokens_per_s'] / tps:.0%}" if tps else "-"
    each = ", ".join(f"{x:.1f}" for x in r["all_tokens_per_s"])
    name = f"{r['system']} (call {r['phase']})" if several else r["system"]
    st = r.get("stats") or {}
    if r["batch"] > 1 and "joined_calls" in st:  # the last rep's rounds batched across requests
        name += f" [{st['joined_rounds']} rounds joined in {st['joined_calls']} calls]"
    return (
        f"| {name} | {r['batch']} | {r.get('tokens', 0) // r['batch']} | "
        f"{r['tokens_per_s']:.1f} | {ratio} | {pred} | {mb} | {b_txt} | {share} | {each} |"
    )


def plot(runs: list[dict], ar: dict, path: Path) -> None:
    """Ratio to ``ar`` of every batch-1 system, one bar group per backend and pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in runs if r["batch"] == 1 and r["method"] != "ar"]
    groups = list(dict.fromkeys((r["backend"], r["pair"]) for r in sel))
    if not groups:
        return
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4), squeeze=False)
    for ax, (backend, pair) in zip(axes[0], groups, strict=True):
        rs = [r for r in sel if (r["backend"], r["pair"]) == (backend, pair)]
        ratios = [r["tokens_per_s"] / (ar.get(_ar_key(r)) or 1.0) for r in rs]
        several = len({r["phase"] for r in rs}) > 1
        names = [f"{r['system']} (call {r['phase']})" if several else r["system"] for r in rs]
        ax.bar(names, ratios)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(f"{backend} {pair}: tokens/s over ar (batch 1)")
        ax.tick_params(axis="x", rotation=60, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU rehearsal)")
    ap.add_argument("--out", required=True, help="folder for results.jsonl, report.md, png")
    ap.add_argument("--workdir", default=None, help="where GGUF files go (default OUT/models)")
    ap.add_argument("--backends", default="torch,llamacpp")
    ap.add_argument("--pairs", default="qwen,llama")
    ap.add_argument("--particles", default="4,8,16")
    ap.add_argument("--draft-tokens", default="2,4,8")
    ap.add_argument(
        "--batches",
        default="8,32",
        help="concurrent requests for the ar / smc-n8-k8 groups; 1 adds none (the grid is batch 1)",
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--upper-bound-pairs",
        default="qwen",
        help="pairs that also run sd with draft = target (target loaded twice)",
    )
    ap.add_argument("--threads", type=int, default=4, help="llama.cpp CPU threads")
    ap.add_argument(
        "--logits-device",
        choices=("cpu", "cuda"),
        help="llamacpp: where logits go for sampling (default: --device)",
    )
    ap.add_argument("--kv-cells", type=int, default=65536)
    ap.add_argument(
        "--compare-steps",
        default="8,8",
        help="torch: N,K of the SMC-SD setting also run with rounds step by step, beside ar "
        "both ways, in a first group ('none' for none)",
    )
    ap.add_argument(
        "--compare-kernels",
        default="8,8",
        help="torch: N,K of the SMC-SD setting run with each of --kernel-sets, beside ar with "
        "each, in a group of its own ('none' for none)",
    )
    ap.add_argument(
        "--kernel-sets",
        default="eager,compiled,flex,layer",
        help="torch: the kernel sets of --compare-kernels (smcspec.backends.torch.kernels)",
    )
    ap.add_argument(
        "--compare-frontier",
        default="8,8,4",
        help="torch: N,K,K_sd: after the grid, SMC-SD N,K with block and with ESS-cut "
        "rounds, chain sd K_sd and multi-draft sd N,K_sd, on the pair's own draft ('none' "
        "for none)",
    )
    ap.add_argument(
        "--compare-fp8",
        default="8,8",
        help="torch: after the pair's other groups, convert its projections to FP8 and run ar "
        "and SMC-SD at N,K (rows under PAIR-fp8; 'none' for none)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="torch: one SMC-SD request under cProfile after each pair's groups",
    )
    ap.add_argument(
        "--profile-kernels",
        default="",
        help="torch: kernel sets whose SMC-SD request (N,K of --compare-kernels) runs under "
        "torch.profiler after the groups, kernels and device time a round beside their "
        "prediction (benchmarks/campaign_kernels.py; e.g. eager,layer)",
    )
    ap.add_argument(
        "--bandwidth",
        type=float,
        default=4.8e12,
        help="bytes/s of the bound rows (the H200 datasheet's 4.8 TB/s)",
    )
    ap.add_argument(
        "--peak-flops",
        type=float,
        default=989e12,
        help="FLOP/s of the batch bounds (the H200 datasheet's dense bf16: 989 TFLOP/s)",
    )
    ap.add_argument(
        "--pair-stats",
        default=None,
        metavar="FILE",
        help="torch: run the tuner on this device with the pair's acceptance statistics from "
        "FILE (measured with real weights: benchmarks/pair_stats/) after each pair's rooflines",
    )
    ap.add_argument("--tune-draft-tokens", default="2,4,8,12,16,32", help="the tuner's K values")
    ap.add_argument(
        "--llama-speculative",
        default=None,
        metavar="BIN",
        help="llamacpp, pair llama: also run llama.cpp's llama-speculative binary BIN on the "
        "same GGUF files (scripts/build_llamacpp_libs.sh --tools); skipped if BIN is missing",
    )
    ap.add_argument("--speculative-k", default="4,8", help="llama-speculative's K values")
    ap.add_argument(
        "--weights",
        choices=("native", "fp8"),
        default="native",
        help="torch: the layers' projections in FP8 (e4m3, a scale per output channel; "
        "rows under PAIR-fp8); llamacpp runs its GGUF files as written",
    )
    ap.add_argument("--deadline-s", type=float, default=1e9, help="skip what starts later")
    ap.add_argument("--min-step-s", type=float, default=20.0)
    ap.add_argument(
        "--no-roofline",
        dest="roofline",
        action="store_false",
        help="skip the forward-cost measurements",
    )
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="write report.md from OUT/results.jsonl (e.g. two runs' rows joined)",
    )
    args = ap.parse_args(argv)
    args.particles = [int(x) for x in args.particles.split(",")]
    args.draft_tokens = [int(x) for x in args.draft_tokens.split(",")]
    args.tune_draft_tokens = [int(x) for x in args.tune_draft_tokens.split(",")]
    args.speculative_k = [int(x) for x in args.speculative_k.split(",")]
    args.batches = [int(x) for x in args.batches.split(",") if x]
    args.upper_bound_pairs = args.upper_bound_pairs.split(",")
    args.compare_steps = _n_k(args.compare_steps)
    args.compare_kernels = _n_k(args.compare_kernels)
    args.compare_frontier = _n_k(args.compare_frontier)
    if args.compare_frontier and len(args.compare_frontier) != 3:
        ap.error("--compare-frontier takes N,K,K_sd or none")
    args.kernel_sets = [x for x in args.kernel_sets.split(",") if x]
    args.profile_kernels = [x for x in args.profile_kernels.split(",") if x]
    unknown = sorted(set(args.kernel_sets + args.profile_kernels) - set(KERNEL_SETS))
    if unknown:
        ap.error(f"--kernel-sets/--profile-kernels: {unknown} not among {list(KERNEL_SETS)}")
    args.compare_fp8 = _n_k(args.compare_fp8)
    args.workdir = args.workdir or str(Path(args.out) / "models")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    return args


def _n_k(text: str) -> tuple[int, ...] | None:
    """``"N,K"`` as ``(N, K)``; ``"none"`` or empty as None."""
    text = "" if text == "none" else text
    return tuple(int(x) for x in text.split(",") if x) or None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":  # the rehearsal counts kernels from CPU events (kernel_count)
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    c = Campaign(args)
    env = environment(args)
    command = ["python", "benchmarks/gpu_campaign.py", *(sys.argv[1:] if argv is None else argv)]
    if args.report_only:
        report(c, env, command)
        return 0
    c.row(kind="environment", command=" ".join(command), **env)
    failed = 0
    try:
        for backend in args.backends.split(","):
            for pair in args.pairs.split(","):
                if backend == "llamacpp" and not env["llama_cpp_ok"]:
                    c.skip(f"llamacpp/{pair}: {env['llama_cpp']}")
                    continue
                if backend == "llamacpp" and pair in TORCH_ONLY:
                    c.skip(f"llamacpp/{pair}: torch only (no GGUF of this size is written)")
                    continue
                try:
                    measure(c, backend, pair)
                except Exception as exc:  # one failing backend must not lose the others
                    failed += 1
                    c.skip(f"{backend}/{pair}: failed: {exc!r}")
                    c.row(kind="error", backend=backend, pair=pair, error=repr(exc))
    finally:
        report(c, env, command)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
