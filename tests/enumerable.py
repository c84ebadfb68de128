"""Tiny random transformers whose output distribution can be enumerated exactly."""

from __future__ import annotations

import itertools

import torch

from smcspec.models.config import ModelConfig
from smcspec.models.transformer import Transformer


def tiny_transformer(
    seed: int, vocab: int = 4, scale: float = 0.3, base: Transformer | None = None
) -> Transformer:
    """A 1-layer Qwen2-style model with random weights (std ``scale``) and ``vocab`` tokens.

    With ``base``, the weights are ``base``'s plus the random ones (a perturbed copy: a draft
    that resembles its target).
    """
    cfg = ModelConfig(
        model_type="qwen2",
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        qkv_bias=True,
        tie_word_embeddings=False,
    )
    g = torch.Generator().manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            p.copy_(torch.randn(p.shape, generator=g) * scale)
            if base is not None:
                p.add_(base.get_parameter(name))
    return model.eval()


def sequence_log_probs(model: Transformer, prompt: list[int], length: int, temperature: float):
    """Exact ``log p_T(x_1..x_L | prompt)`` for every sequence: dict tuple -> float."""
    vocab = model.cfg.vocab_size
    seqs = list(itertools.product(range(vocab), repeat=length))
    out = {}
    for seq in seqs:
        cache = model.new_cache(1, length + 1)
        first = model.prefill(torch.tensor(prompt), cache)
        logits = torch.cat((first[None], model.decode(torch.tensor([seq[:-1]]), cache)[0]))
        if length == 1:
            logits = first[None]
        lp = torch.log_softmax(logits.double() / temperature, -1)
        out[seq] = float(lp[torch.arange(length), torch.tensor(seq)].sum())
    return out


def total_variation(p: dict, counts: dict, n: int) -> float:
    """TV distance between an exact distribution ``p`` (log-probs) and empirical counts."""
    keys = set(p) | set(counts)
    return 0.5 * sum(
        abs(torch.tensor(p.get(k, -float("inf"))).exp().item() - counts.get(k, 0) / n) for k in keys
    )
