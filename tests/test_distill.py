"""``smcspec distill`` on a tiny pair: the objectives' formulas, the teacher's alignment, a
fit that lowers its objective on held-out answers with the base frozen, the export both
backends load with the trained model's logits, resuming after a kill, and bad input refused
before any model loads.

The tiny pair is two random qwen2 GGUF files (target seed 0, draft seed 1, 96 tokens): far
apart (per-token D2 about 31 nats), so one short fit moves every figure clearly.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil

import pytest
import torch
from tiny_models import CHAT_TEMPLATE, make_tiny_gguf

from smcspec import ConfigError
from smcspec.distill import objectives as obj
from smcspec.distill.data import read_prompt_file
from smcspec.distill.run import DistillConfig, distill
from smcspec.distill.teacher import read_records
from smcspec.distill.training import (
    draft_source,
    hf_dir_of,
    load_lora_model,
    record_terms,
    train,
    validate,
)
from smcspec.errors import ModelFileError

pytest.importorskip("peft")
pytest.importorskip("llama_cpp")

DOMAINS = ("chat", "code", "math")


def _prompt_file(path, per_domain: int = 24) -> None:
    rng = random.Random(0)
    lines = []
    for d in DOMAINS:
        for _ in range(per_domain):
            words = " ".join("".join(rng.choice("abcdefghij") for _ in range(4)) for _ in range(5))
            lines.append(json.dumps({"prompt": f"{d} {words}", "domain": d}))
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Tiny target and draft GGUF files, a prompt file, and the teacher's answers made once."""
    root = tmp_path_factory.mktemp("distill")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SMCSPEC_CACHE", str(root / "cache"))
        target, draft = (
            make_tiny_gguf(root, "qwen2", 96, seed=s, chat_template=CHAT_TEMPLATE)[0]
            for s in (0, 1)
        )
        prompts = root / "prompts.jsonl"
        _prompt_file(prompts)
        cfg = _cfg(root / "teacher", target, draft, prompts, stage="data")
        distill(cfg, log=lambda line: None)
    return {"root": root, "target": target, "draft": draft, "prompts": prompts,
            "teacher": root / "teacher"}  # fmt: skip


def _cfg(out, target, draft, prompts, **kw) -> DistillConfig:
    settings = dict(out=out, target=str(target), draft=str(draft), data=str(prompts),
                    tokens=900, max_new_tokens=30, step_tokens=64, lr=3e-3, threads=1,
                    validations=2, checkpoint_every=2, concurrency=2)  # fmt: skip
    return DistillConfig(**{**settings, **kw})


# ---------------------------------------------------------------------- objectives


def _random_pair(seed: int, rows: int = 6, vocab: int = 9):
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 2, -1)
    lq = torch.log_softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 2, -1)
    return lp, lq


def test_divergences_equal_their_formulas_and_are_not_symmetric():
    lp, lq = _random_pair(0)
    p, q = lp.exp(), lq.exp()
    torch.testing.assert_close(obj.d2(lp, lq), torch.log((p**2 / q).sum(-1)))
    torch.testing.assert_close(obj.kl(lp, lq), (p * (p / q).log()).sum(-1))
    torch.testing.assert_close(obj.reverse_kl(lp, lq), (q * (q / p).log()).sum(-1))
    torch.testing.assert_close(obj.tv(lp, lq), 0.5 * (p - q).abs().sum(-1))
    torch.testing.assert_close(obj.renyi(lp, lq, 2.0), obj.d2(lp, lq))
    torch.testing.assert_close(obj.renyi(lp, lq, 1.0 + 1e-7), obj.kl(lp, lq), atol=1e-5, rtol=0)
    # p and q swapped in D2 gives another number (the broken variant this test must catch)
    assert float((obj.d2(lq, lp) - obj.d2(lp, lq)).abs().max()) > 0.1
    assert (
        obj.anneal_alpha(0.0) == 1.0 and obj.anneal_alpha(0.5) == 1.5 and obj.anneal_alpha(2) == 2
    )


def test_buckets_fold_the_rest_and_bound_each_divergence_from_below():
    lp, lq = _random_pair(1, vocab=12)
    top_lp, top_ids = lp.topk(4, -1)
    blp, blq = obj.bucket_logprobs(top_ids, top_lp.float(), lq.float())
    torch.testing.assert_close(blp.exp().sum(-1), torch.ones(6), atol=1e-6, rtol=0)
    torch.testing.assert_close(blq.exp().sum(-1), torch.ones(6), atol=1e-6, rtol=0)
    for f in (obj.d2, obj.kl, obj.tv):  # merging outcomes never raises a divergence
        assert bool((f(blp, blq) <= f(lp, lq).float() + 1e-5).all())
    # with every token kept the buckets are exact
    all_lp, all_ids = lp.topk(12, -1)
    blp, blq = obj.bucket_logprobs(all_ids, all_lp.float(), lq.float())
    torch.testing.assert_close(obj.d2(blp, blq), obj.d2(lp, lq).float(), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="unknown objective"):
        obj.objective("l2", blp, blq)


# ---------------------------------------------------------------------- teacher and fit


def test_teacher_answers_are_balanced_and_aligned_with_the_target(pair):
    records = read_records(pair["teacher"])
    train_recs = [r for r in records if r.split == "train"]
    assert {r.domain for r in records if r.split == "val"} == set(DOMAINS)
    tokens = {d: sum(len(r.ids) for r in train_recs if r.domain == d) for d in DOMAINS}
    # every domain reaches its share (300 tokens) and stops within two 30-token answers of it
    # (two answers decoded together)
    assert all(300 <= n < 360 for n in tokens.values()), tokens
    for r in records:
        assert len(r.top_ids) == len(r.ids) == len(r.top_logprobs) and len(r.top_ids[0]) == 20
    # the target as its own student: every divergence is zero only if position j of the
    # teacher is scored against the draft's distribution for token j (a one-position shift
    # gives D2 in the tens of nats)
    model = load_lora_model(hf_dir_of(pair["target"], "t"), 2, 4.0, 0)
    model.eval()
    with torch.no_grad():
        figures = validate(model, records[:6], 0.7, "cpu")["all"]
        lp, lq = record_terms(model, records[0], 0.7, "cpu")
        shifted = obj.d2(lp[1:], lq[:-1]).mean()
    # measured: D2 7e-5, KL 3e-5, TV 0.0016 (the teacher ran on llama.cpp, f16 KV; the
    # student is transformers in float32)
    assert figures["d2"] < 1e-3 and figures["kl"] < 1e-3 and figures["tv"] < 1e-2, figures
    assert float(shifted) > 1.0


def test_a_fit_lowers_the_objective_on_held_out_answers_and_leaves_the_base_alone(pair, tmp_path):
    cfg = _cfg(tmp_path / "fit", pair["target"], pair["draft"], pair["prompts"],
               teacher=pair["teacher"])  # fmt: skip
    state = train(cfg, log=lambda line: None)
    rows = [json.loads(x) for x in (cfg.out / "validation.jsonl").read_text().splitlines()]
    curve = [r for r in rows if r["domain"] == "all"]
    assert [r["tokens"] for r in curve][0] == 0 and len(curve) == 3
    # measured: D2 31.2 -> 29.9, TV 0.951 -> 0.946 over 900 tokens
    assert curve[-1]["d2"] < curve[0]["d2"] - 0.5, curve
    assert curve[-1]["kl"] < curve[0]["kl"] - 0.3, curve
    assert state["done"] and state["tokens"] >= 900
    # only the adapters learn: the base's weights equal the file's
    path, sha = draft_source(cfg)
    fresh = load_lora_model(hf_dir_of(path, sha), cfg.rank, cfg.lora_alpha, cfg.seed)
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(fresh, load_file(str(cfg.out / "checkpoint/adapter.safetensors")))
    for name, p in fresh.named_parameters():
        assert p.requires_grad == ("lora_" in name), name
    base = load_lora_model(hf_dir_of(path, sha), cfg.rank, cfg.lora_alpha, cfg.seed)
    base_weights = {n: p for n, p in base.named_parameters() if "lora_" not in n}
    for n, p in fresh.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base_weights[n]), n


def test_a_killed_run_resumes_to_the_uninterrupted_weights(pair, tmp_path):
    from safetensors.torch import load_file

    whole = _cfg(tmp_path / "whole", pair["target"], pair["draft"], pair["prompts"],
                 teacher=pair["teacher"], validations=0)  # fmt: skip
    train(whole, log=lambda line: None)
    parts = _cfg(tmp_path / "parts", pair["target"], pair["draft"], pair["prompts"],
                 teacher=pair["teacher"], validations=0, checkpoint_every=100)  # fmt: skip
    first = train(parts, log=lambda line: None, max_steps=3)  # a kill after three steps
    assert not first["done"] and first["step"] == 3
    resumed = train(parts, log=lambda line: None)
    assert resumed["done"] and resumed["step"] > 3
    a = load_file(str(whole.out / "checkpoint/adapter.safetensors"))
    b = load_file(str(parts.out / "checkpoint/adapter.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
    # another run's checkpoint in --out is refused
    other = _cfg(tmp_path / "parts", pair["target"], pair["draft"], pair["prompts"],
                 teacher=pair["teacher"], validations=0, lr=1e-3)  # fmt: skip
    with pytest.raises(ConfigError, match="checkpoint of another run"):
        train(other, log=lambda line: None)


def test_the_export_gives_the_trained_logits_on_both_backends(pair, tmp_path, monkeypatch):
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from smcspec.backends.llamacpp import LlamaCppSettings
    from smcspec.models import load_model

    monkeypatch.setenv("SMCSPEC_CACHE", str(pair["root"] / "cache"))
    cfg = _cfg(tmp_path / "run", pair["target"], pair["draft"], pair["prompts"],
               teacher=pair["teacher"], stage="all", validations=0)  # fmt: skip
    folder = distill(cfg, log=lambda line: None)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["kind"] == "smcspec-fitted-draft" and manifest["objective"] == "chi2"
    assert manifest["name"] == "tiny-qwen2-s1-chi2"
    assert set(manifest["data"]["domain_shares"]) == set(DOMAINS)
    assert math.isclose(sum(manifest["data"]["domain_shares"].values()), 1, abs_tol=1e-3)
    path, sha = draft_source(cfg)
    ref = load_lora_model(hf_dir_of(path, sha), cfg.rank, cfg.lora_alpha, cfg.seed)
    set_peft_model_state_dict(ref, load_file(str(cfg.out / "checkpoint/adapter.safetensors")))
    ref.eval()
    ids = [5, 17, 33, 2, 60, 41, 7, 9]
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([ids])).logits[0, -1]
        with ref.disable_adapter():
            base = ref(input_ids=torch.tensor([ids])).logits[0, -1]
    moved = float((want - base).abs().max())
    # measured: torch 6e-4 (the adapter stored in float16), llamacpp 0.033 (llama.cpp's own
    # arithmetic, as tests/test_backend_llamacpp.py bounds it); training moved them by ~2.9
    for backend, atol in (("torch", 5e-3), ("llamacpp", 0.1)):
        kw = {"llamacpp": LlamaCppSettings(threads=1)} if backend == "llamacpp" else {}
        model = load_model(folder, backend=backend, tokenizer=backend == "torch", **kw)
        assert model.name == "tiny-qwen2-s1-chi2"
        got = model.model.prefill(torch.tensor(ids), model.model.new_cache(1, 16))
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)
        assert moved > 20 * atol
    # an altered adapter is refused
    adapter = folder / "draft-lora.gguf"
    adapter.write_bytes(adapter.read_bytes()[:-2] + b"\0\0")
    with pytest.raises(ModelFileError, match="altered adapter"):
        load_model(folder, backend="torch")


# ---------------------------------------------------------------------- bad input


def test_bad_prompt_files_are_refused_before_any_model_loads(tmp_path):
    cases = {
        "missing": None,
        "empty": b"",
        "binary": b"abc\0def\n",
        "bad-json": b'{"prompt": 3}\n',
        "bad-domain": b'{"prompt": "x", "domain": "a b"}\n',
        "too-few": b"one\ntwo\n",
    }
    for name, content in cases.items():
        f = tmp_path / name
        if content is not None:
            f.write_bytes(content)
        with pytest.raises(ConfigError):
            read_prompt_file(f)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for f in (fifo, "/dev/zero", tmp_path):
        with pytest.raises(ConfigError, match="not a regular file"):
            read_prompt_file(f)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"tokens": 10}, "tokens must be"),
        ({"objective": "l2"}, "unknown objective"),
        ({"rank": 0}, "rank must be"),
        ({"lr": float("nan")}, "lr must be"),
        ({"data": "/dev/zero"}, "not a regular file"),
    ],
)
def test_bad_settings_are_clear_errors(tmp_path, change, message):
    cfg = DistillConfig(out=tmp_path / "o", target="/nonexistent.gguf", **change)
    with pytest.raises(ConfigError, match=message):
        distill(cfg, log=lambda line: None)


def test_the_cli_refuses_bad_input_with_one_line(tmp_path, capsys):
    from smcspec.cli import main

    assert main(["distill", "--out", str(tmp_path / "o"), "--data", "/dev/zero"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "not a regular file" in err


def test_vocabularies_that_differ_are_refused(pair, tmp_path):
    other = make_tiny_gguf(tmp_path, "qwen2", 80, seed=3, chat_template=CHAT_TEMPLATE)[0]
    cfg = _cfg(tmp_path / "v", pair["target"], other, pair["prompts"], teacher=pair["teacher"])
    with pytest.raises(ModelFileError, match="vocabularies differ"):
        distill(cfg, log=lambda line: None)
    shutil.rmtree(tmp_path / "v", ignore_errors=True)


def test_a_rounding_rest_adds_nothing_to_reverse_kl():
    """A target whose kept tokens hold all but rounding (1e-7) of its mass, and a draft with
    1e-3 outside them: the bucketed reverse KL stays below the full one (taking the target's
    rest as zero made it 1e-3 * log(1e-3 / e^-1e4), about 10)."""
    lp = torch.log(torch.tensor([[0.6, 0.4 - 1e-7, 1e-7 / 3, 1e-7 / 3, 1e-7 / 3]]))
    lq = torch.log(torch.tensor([[0.5, 0.499, 0.0005, 0.0003, 0.0002]]))
    top_lp, top_ids = lp.topk(2, -1)
    blp, blq = obj.bucket_logprobs(top_ids, top_lp, lq)
    for f in (obj.reverse_kl, obj.d2, obj.kl, obj.tv):
        assert float(f(blp, blq)) <= float(f(lp, lq)) + 1e-6, f.__name__
