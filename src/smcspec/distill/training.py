"""Stage 2 of ``smcspec distill``: LoRA adapters on the draft, fitted to the teacher's kept
distributions (:mod:`smcspec.distill.teacher`) with the chosen objective
(:mod:`smcspec.distill.objectives`). The target never runs here.

The draft is the ``transformers`` model of its Hugging Face directory (a GGUF draft is
dequantized into one first, :mod:`smcspec.models.gguf_convert`); PEFT wraps its projections
in LoRA adapters (Hu et al. 2021) and freezes every base weight. One answer at a time: the
draft reads the prompt and the answer's tokens but the last, and its distribution at answer
position ``j`` (the logits at input position ``P + j - 1``, after the temperature) is scored
against the target's at ``j``. An optimizer step takes ``step_tokens`` answer tokens (AdamW,
gradients clipped to norm 1, linear warm-up then cosine decay); the loss is the mean
objective per answer token.

Resumable: every ``checkpoint_every`` steps the adapter, the optimizer, the schedule and the
position in the (seeded, fixed) order are written to ``OUT/checkpoint/`` (a new folder moved
in place of the old, so a kill never leaves half a checkpoint); a rerun continues from it, and
under the same seed and thread count ends with the weights an uninterrupted run gets. A
folder whose checkpoint was made with other settings is refused.

Validation (``OUT/validation.jsonl``): before training and ``validations`` times over it, the
per-token D2, KL, TV and chain-sd acceptance ``1 - TV`` of each domain's held-out answers.
"""

from __future__ import annotations

import json
import math
import os
import random
import resource
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from smcspec.distill.objectives import bucket_logprobs, divergences, objective
from smcspec.distill.teacher import TEACHER_META, TeacherRecord, read_records
from smcspec.errors import ConfigError

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CHECKPOINT = "checkpoint"
VALIDATION = "validation.jsonl"
WARMUP = 0.05  # of the steps
FLOOR = 0.1  # the cosine schedule's last learning rate, as a share of the peak


@dataclass(frozen=True)
class Fingerprint:
    """What a checkpoint was made with; a resumed run must match it."""

    objective: str
    rank: int
    lora_alpha: float
    lr: float
    step_tokens: int
    seed: int
    tokens: int
    temperature: float
    draft: str
    teacher_sha256: str


def draft_source(cfg) -> tuple[Path, str]:
    """The draft to fit: its file or folder and its SHA-256 (a folder's: of its
    ``config.json`` and weights' names and sizes). The default pair's when ``cfg.draft`` is
    None (assembled from its packages on first use).

    Raises:
        ModelFileError: a missing path.
    """
    from smcspec.errors import ModelFileError
    from smcspec.models.default_pair import DEFAULT_DRAFT, ensure_packaged_model
    from smcspec.models.fitted_draft import dir_fingerprint
    from smcspec.models.gguf_convert import sha256_file
    from smcspec.models.loading import cache_root

    if cfg.draft is None:
        return ensure_packaged_model(DEFAULT_DRAFT, cache_root()), DEFAULT_DRAFT.sha256
    p = Path(cfg.draft).expanduser()
    if not p.exists():
        raise ModelFileError(f"draft path does not exist: {p}")
    if p.is_file():
        return p, sha256_file(p)
    return p, dir_fingerprint(p)


def hf_dir_of(path: Path, sha256: str) -> Path:
    """A Hugging Face folder of the draft (a GGUF file converted once into the cache)."""
    from smcspec.models.gguf_convert import converted_dir
    from smcspec.models.loading import cache_root

    return converted_dir(path, cache_root(), sha256=sha256) if path.is_file() else path


def load_lora_model(hf_dir: Path, rank: int, alpha: float, seed: int, device: str = "cpu"):
    """The draft of ``hf_dir`` in ``transformers``, float32, wrapped by PEFT in LoRA adapters
    of ``rank`` on :data:`TARGET_MODULES` (their ``A`` seeded with ``seed``; ``B`` zero, so
    the wrapped model starts equal to the base). Every base weight is frozen."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    lcfg = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(TARGET_MODULES), lora_dropout=0.0,
        bias="none",
    )  # fmt: skip
    return get_peft_model(base, lcfg).to(device)


def draft_logprobs(
    model, record: TeacherRecord, temperature: float, device: str, body_dtype: str = "float32"
) -> torch.Tensor:
    """float32 ``[L, V]``: the draft's ``log_softmax(logits / T)`` at each of the record's
    ``L`` answer positions (input: the prompt and the answer but its last token).

    ``body_dtype`` ``bfloat16`` runs the layers under bfloat16 autocast (2-3x the float32
    matmul rate on a CPU with AVX512-BF16); the output head always runs in float32, whose
    logits of magnitude 20 bfloat16 would round to 0.125.
    """
    ids = record.prompt_ids + record.ids[:-1]
    x = torch.tensor([ids], device=device)
    body = model.get_base_model().model
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16,
                        enabled=body_dtype == "bfloat16"):  # fmt: skip
        hidden = body(input_ids=x).last_hidden_state[0, -len(record.ids) :]
    head = model.get_output_embeddings().weight
    logits = torch.nn.functional.linear(hidden.float(), head.float())
    return torch.log_softmax(logits / temperature, dim=-1)


def record_terms(
    model, record: TeacherRecord, temperature: float, device: str, body_dtype: str = "float32"
):
    """``(lp, lq)`` bucket log-probabilities ``[L, k + 1]`` of one record (see
    :func:`smcspec.distill.objectives.bucket_logprobs` and :func:`draft_logprobs`)."""
    lq_all = draft_logprobs(model, record, temperature, device, body_dtype)
    top_ids = torch.tensor(record.top_ids, device=device)
    top_lp = torch.tensor(record.top_logprobs, device=device)
    return bucket_logprobs(top_ids, top_lp, lq_all)


@torch.no_grad()
def validate(
    model,
    records: list[TeacherRecord],
    temperature: float,
    device: str,
    body_dtype: str = "float32",
) -> dict:
    """Per domain: the mean per-token ``d2``, ``kl``, ``tv`` and ``acceptance`` over the
    records, and ``positions`` (answer tokens scored); ``all`` pools the domains."""
    sums: dict[str, dict[str, float]] = {}
    for r in records:
        lp, lq = record_terms(model, r, temperature, device, body_dtype)
        figures = divergences(lp, lq)
        for key in (r.domain, "all"):
            s = sums.setdefault(key, {"positions": 0.0})
            s["positions"] += lp.shape[0]
            for name, v in figures.items():
                s[name] = s.get(name, 0.0) + float(v.double().sum())
    return {
        d: {k: (v if k == "positions" else v / s["positions"]) for k, v in s.items()}
        for d, s in sums.items()
    }


def step_groups(records: list[TeacherRecord], step_tokens: int, seed: int) -> list[list[int]]:
    """The training order, fixed by ``seed``: record indices shuffled, cut into steps of at
    least ``step_tokens`` answer tokens (the last step may hold fewer)."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    groups, cur, n = [], [], 0
    for i in order:
        cur.append(i)
        n += len(records[i].ids)
        if n >= step_tokens:
            groups.append(cur)
            cur, n = [], 0
    if cur:
        groups.append(cur)
    return groups


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over :data:`WARMUP` of the steps, then cosine decay to :data:`FLOOR`."""
    warm = max(1, round(WARMUP * steps))
    if step < warm:
        return (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def teacher_records(cfg) -> tuple[list[TeacherRecord], list[TeacherRecord], str]:
    """The training and validation records of the run's teacher folder, and its digest.

    Raises:
        ConfigError: no teacher answers there (run the data stage first), or a teacher
            made at another temperature.
    """
    import hashlib

    folder = cfg.teacher_dir
    meta_path = folder / TEACHER_META
    records = read_records(folder)
    train = [r for r in records if r.split == "train"]
    if not meta_path.is_file() or not train:
        raise ConfigError(f"{folder} holds no teacher answers; run the data stage first")
    meta = json.loads(meta_path.read_text())
    if abs(meta["temperature"] - cfg.temperature) > 1e-9:
        raise ConfigError(
            f"the teacher answers in {folder} were made at temperature {meta['temperature']}, "
            f"not {cfg.temperature}"
        )
    h = hashlib.sha256(meta_path.read_bytes())
    for r in train:
        h.update(r.id.encode())
    return train, [r for r in records if r.split == "val"], h.hexdigest()


def _save_checkpoint(out: Path, model, opt, sched, state: dict) -> None:
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    tmp, final, old = out / (CHECKPOINT + ".tmp"), out / CHECKPOINT, out / (CHECKPOINT + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    adapter = {
        k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()
    }
    save_file(adapter, str(tmp / "adapter.safetensors"))
    torch.save({"optimizer": opt.state_dict(), "schedule": sched.state_dict()}, tmp / "optim.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=1) + "\n")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def read_checkpoint_state(out: Path) -> dict | None:
    """The state of ``out``'s checkpoint (``checkpoint/``, or ``checkpoint.old`` left by a
    kill between the two renames), or None."""
    for name in (CHECKPOINT, CHECKPOINT + ".old"):
        p = out / name / "state.json"
        if p.is_file():
            return {**json.loads(p.read_text()), "folder": str(out / name)}
    return None


def check_checkpoint(out: Path, fingerprint: Fingerprint) -> dict | None:
    """The checkpoint's state if it was made with ``fingerprint``, None if there is none.

    Raises:
        ConfigError: ``out`` holds another run's checkpoint.
    """
    state = read_checkpoint_state(out)
    if state is None:
        return None
    theirs = state.get("fingerprint", {})
    for key, value in asdict(fingerprint).items():
        if theirs.get(key) != value:
            raise ConfigError(
                f"{out} holds the checkpoint of another run ({key}={theirs.get(key)!r}, this "
                f"run {value!r}); use another --out, or the same settings to resume"
            )
    return state


def _load_checkpoint(state: dict, model, opt, sched) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    folder = Path(state["folder"])
    set_peft_model_state_dict(model, load_file(str(folder / "adapter.safetensors")))
    saved = torch.load(folder / "optim.pt", weights_only=True)
    opt.load_state_dict(saved["optimizer"])
    sched.load_state_dict(saved["schedule"])


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, MiB (Linux's ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def validation_milestones(total: int, validations: int) -> list[int]:
    """The training tokens after which the fit validates: 0, then ``validations`` evenly
    spaced up to ``total`` (none when ``validations`` is 0)."""
    if not validations:
        return []
    return [0, *(round(total * j / validations) for j in range(1, validations + 1))]


def _validate_if_due(model, val_recs, cfg, state: dict, milestones: list[int], log) -> None:
    """Validate (and append the figures per domain to ``cfg.out``'s validation file) when
    ``state["tokens"]`` has passed a milestone not yet validated; ``state["validated"]``
    records the last one done, so a resumed run does not repeat it."""
    due = [i for i, m in enumerate(milestones) if state["tokens"] >= m]
    if not due or due[-1] <= state["validated"]:
        return
    model.eval()
    figures = validate(model, val_recs, cfg.temperature, cfg.device, cfg.dtype)
    model.train()
    with open(cfg.out / VALIDATION, "a") as fh:
        for domain, f in sorted(figures.items()):
            fh.write(json.dumps({"tokens": state["tokens"], "step": state["step"],
                                 "domain": domain, **f}) + "\n")  # fmt: skip
    state["validated"] = due[-1]
    a = figures.get("all", {})
    log(f"validation at {state['tokens']:,} tokens: D2 {a.get('d2', 0):.4f} "
        f"KL {a.get('kl', 0):.4f} TV {a.get('tv', 0):.4f}")  # fmt: skip


def _fit_step(model, group: list[TeacherRecord], cfg, progress: float, params, opt) -> float:
    """One optimiser step on ``group``'s answers: the objective summed over their positions
    over the group's token count, gradients clipped at norm 1; returns the step's loss."""
    n = sum(len(r.ids) for r in group)
    loss_sum = 0.0
    for r in group:
        lp, lq = record_terms(model, r, cfg.temperature, cfg.device, cfg.dtype)
        loss = objective(cfg.objective, lp, lq, progress).sum() / n
        loss.backward()
        loss_sum += loss.item()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss_sum


def train(cfg, log: Callable[[str], None], max_steps: int | None = None) -> dict:
    """Fit the adapters (see the module notes); return the final state (steps, tokens,
    seconds, peak RSS). ``max_steps`` stops early after that many steps in this call (a
    test's simulated kill), with a checkpoint written.

    Raises:
        ConfigError: no teacher answers, another run's checkpoint in ``cfg.out``, a draft
            whose vocabulary cannot hold the teacher's token ids.
    """
    from tqdm import tqdm

    train_recs, val_recs, teacher_sha = teacher_records(cfg)
    path, sha = draft_source(cfg)
    fp = Fingerprint(cfg.objective, cfg.rank, float(cfg.lora_alpha), float(cfg.lr),
                     cfg.step_tokens, cfg.seed, cfg.tokens, float(cfg.temperature), sha,
                     teacher_sha)  # fmt: skip
    cfg.out.mkdir(parents=True, exist_ok=True)
    state = check_checkpoint(cfg.out, fp)
    if state is not None and state.get("done"):
        log(f"training already finished in {cfg.out} ({state['tokens']:,} tokens)")
        return state
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model = load_lora_model(hf_dir_of(path, sha), cfg.rank, cfg.lora_alpha, cfg.seed, cfg.device)
    vocab = model.get_input_embeddings().weight.shape[0]
    if max(max(r.ids + r.prompt_ids) for r in train_recs) >= vocab:
        raise ConfigError(f"the teacher's token ids do not fit the draft's vocabulary of {vocab}")
    groups = step_groups(train_recs, cfg.step_tokens, cfg.seed)
    total = sum(len(r.ids) for r in train_recs)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, len(groups)))
    state = state or {"step": 0, "tokens": 0, "seconds": 0.0, "validated": -1,
                      "fingerprint": asdict(fp)}  # fmt: skip
    if state["step"] > 0:
        _load_checkpoint(state, model, opt, sched)
        log(f"resuming {cfg.out} at step {state['step']} of {len(groups)} "
            f"({state['tokens']:,} tokens)")  # fmt: skip
    milestones = validation_milestones(total, cfg.validations)
    model.train()
    _validate_if_due(model, val_recs, cfg, state, milestones, log)
    bar = tqdm(total=total, initial=state["tokens"], unit="tok", desc=f"fit ({cfg.objective})",
               file=sys.stderr)  # fmt: skip
    steps_here = 0
    while state["step"] < len(groups):
        t0 = time.perf_counter()
        group = [train_recs[i] for i in groups[state["step"]]]
        n = sum(len(r.ids) for r in group)
        loss_sum = _fit_step(model, group, cfg, state["tokens"] / max(total, 1), params, opt)
        sched.step()
        state["step"] += 1
        state["tokens"] += n
        state["seconds"] += time.perf_counter() - t0
        state["peak_rss_mib"] = max(state.get("peak_rss_mib", 0.0), peak_rss_mib())
        steps_here += 1
        bar.update(n)
        bar.set_postfix_str(f"loss {loss_sum:.4f} lr {sched.get_last_lr()[0]:.2e}")
        _validate_if_due(model, val_recs, cfg, state, milestones, log)
        last = state["step"] == len(groups)
        state["done"] = last
        stop = max_steps is not None and steps_here >= max_steps
        if last or stop or state["step"] % cfg.checkpoint_every == 0:
            _save_checkpoint(cfg.out, model, opt, sched, state)
        if stop:
            break
    bar.close()
    if state.get("done"):
        log(f"trained on {state['tokens']:,} answer tokens in {state['seconds']:.0f} s "
            f"(peak RSS {state['peak_rss_mib']:.0f} MiB)")  # fmt: skip
    return state
