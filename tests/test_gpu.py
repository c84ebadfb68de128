"""CUDA checks; skipped on machines without a GPU (CI has none)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_hf_model

from smcspec import Engine, GenerationConfig
from smcspec.backends.torch import load_hf_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_forward_matches_cpu(tmp_path):
    d = make_tiny_hf_model(tmp_path, "qwen2", seed=0)
    cpu, gpu = load_hf_dir(d), load_hf_dir(d, device="cuda")
    x = torch.tensor([3, 5, 7, 11, 13, 17])
    c1, c2 = cpu.model.new_cache(1, 4), gpu.model.new_cache(1, 4)
    a = torch.cat((cpu.model.prefill(x[:3], c1)[None], cpu.model.decode(x[None, 3:], c1)[0]))
    b = torch.cat((gpu.model.prefill(x[:3], c2)[None], gpu.model.decode(x[None, 3:], c2)[0]))
    # TF32 may be enabled on the GPU: tolerance 1e-2 on logits of size ~5
    torch.testing.assert_close(b.cpu(), a, atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_cuda_generation(tmp_path, method):
    d = [make_tiny_hf_model(tmp_path / str(s), "qwen2", seed=s) for s in (0, 1)]
    e = Engine(
        load_hf_dir(d[0], device="cuda", dtype="bfloat16"),
        load_hf_dir(d[1], device="cuda", dtype="bfloat16"),
    )
    r = e.generate(
        "ab cd",
        GenerationConfig(method=method, max_new_tokens=10, seed=0, ignore_eos=True),
        chat=False,
    )
    assert r.new_tokens == 10


def test_exact_sd_on_cuda_matches_the_target():
    """Exact SD run on the GPU samples the target's distribution, enumerated on the CPU in
    float64 (the CPU statistical test's pair, prompt and length)."""
    from collections import Counter

    from enumerable import chisquare_p, sequence_log_probs, tiny_transformer, total_variation

    from smcspec.decoding import decode_sd

    target, draft = tiny_transformer(seed=1), tiny_transformer(seed=2)
    prompt, length, runs = [1, 2, 0], 3, 2000
    exact = sequence_log_probs(target, prompt, length, 1.0)
    # one token more than is counted: the second and third come from a full K=2 round, which
    # runs as a CUDA graph (rounds="auto"); a shorter last round runs step by step
    cfg = GenerationConfig(
        method="sd", max_new_tokens=length + 1, draft_tokens=2, temperature=1.0,
        draft_temperature=1.0,
    )  # fmt: skip
    for m in (target, draft):
        m.to("cuda")
        m.inv_freq = m.inv_freq.to("cuda")
    counts: Counter = Counter()
    for i in range(runs):
        g = torch.Generator(device="cuda").manual_seed(i)
        out = decode_sd(target, draft, prompt, cfg, frozenset(), 4, g)
        counts[tuple(out.tokens[:length])] += 1
    # chi-square over the 64 sequences, p-value bound 1e-3; TV at 2000 runs' noise (~0.08)
    assert chisquare_p(exact, counts, runs) > 1e-3
    assert total_variation(exact, counts, runs) < 0.12


def test_cuda_batch_of_shared_and_distinct_rows(tmp_path):
    """One batched forward over a request whose rows hold the same tokens (the distinct-row
    plan builds its tokens on the CPU) beside one whose rows differ: the logits the CPU gives.
    The first GPU campaign (H200, 2026-11-26) failed here: torch.cat of CPU and CUDA tensors."""
    d = make_tiny_hf_model(tmp_path, "qwen2", seed=0)
    x = torch.tensor([3, 5, 7])
    same = torch.full((4, 2), 5)
    diff = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]])
    outs = []
    for model in (load_hf_dir(d).model, load_hf_dir(d, device="cuda").model):
        caches = [model.new_cache(4, 8), model.new_cache(4, 8)]
        for c in caches:
            model.prefill(x.to(model.device), c)
        items = [
            (same.to(model.device), caches[0], False),
            (diff.to(model.device), caches[1], False),
        ]
        outs.append([o.cpu() for o in model.decode_batch(items)])
    for a, b in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(b, a, atol=1e-2, rtol=1e-3)


def test_a_model_moved_to_cuda_after_use_still_runs():
    """``Transformer.to('cuda')`` after a CPU forward: the RoPE table follows the model (the
    campaign's exact-SD test failed on a table left on the CPU)."""
    from enumerable import tiny_transformer

    model = tiny_transformer(seed=1)
    cache = model.new_cache(1, 4)
    ref = model.prefill(torch.tensor([1, 2, 0]), cache)
    model.to("cuda")
    out = model.prefill(torch.tensor([1, 2, 0], device="cuda"), model.new_cache(1, 4))
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_the_uncaptured_fused_rounds(tmp_path, method, dtype):
    """The rounds captured as CUDA graphs (``rounds="graphs"``, the default on CUDA) against the
    same round functions called directly (``eager``): same uniforms in, the same kernels
    replayed, so the same tokens and weights. Several requests, so that graphs captured by
    the first are replayed for the next ones on the same static caches."""
    d = [make_tiny_hf_model(tmp_path / str(s), "qwen2", seed=s) for s in (0, 1)]
    e = Engine(
        load_hf_dir(d[0], device="cuda", dtype=dtype), load_hf_dir(d[1], device="cuda", dtype=dtype)
    )
    models = e.models().values()
    prompt = list(range(3, 40))
    out = {}
    for mode in ("eager", "graphs"):
        for m in models:
            m.rounds = mode
        out[mode] = [
            e.generate(prompt, GenerationConfig(method=method, max_new_tokens=80, particles=4,
                       draft_tokens=4, seed=s, ignore_eos=True, return_particles=method == "smc"))
            for s in range(3)
        ]  # fmt: skip
    for a, b in zip(out["eager"], out["graphs"], strict=True):
        if dtype == "bfloat16" and a.token_ids != b.token_ids:
            # cuBLAS may pick another kernel inside a capture: a bf16 logit off by one unit
            # in the last place can flip a draw, after which the outputs part; they must
            # agree well past the start
            same = next(
                i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y
            )
            assert same >= 16, (same, a.token_ids, b.token_ids)
            continue
        assert a.token_ids == b.token_ids
        if method == "smc":
            wa = torch.tensor([p["weight"] for p in a.particles])
            wb = torch.tensor([p["weight"] for p in b.particles])
            torch.testing.assert_close(wb, wa, rtol=1e-6, atol=1e-9)
    caches = e.target.model.static_slots.slots
    replays = sum(g.replays for c in caches for g in c.graphs.values())
    assert caches and replays > len([g for c in caches for g in c.graphs.values()])


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_concurrent_requests_replay_one_joined_graph(tmp_path, method):
    """Requests run together through the scheduler: their rounds (``ar``, ``sd``, SMC-SD's
    proposals) run as one graph over the bank(s) of their static caches, and each draws what
    it draws alone (float32: the batched forward's sums may differ from one request's in the
    last place only)."""
    from scheduling import run_concurrently

    d = [make_tiny_hf_model(tmp_path / str(s), "qwen2", seed=s) for s in (0, 1)]
    e = Engine(load_hf_dir(d[0], device="cuda"), load_hf_dir(d[1], device="cuda"))
    prompts = [list(range(3, 40)), [5, 6, 7], list(range(10, 30)), [9] * 12]
    settings = dict(method=method, temperature=0.8, particles=4, draft_tokens=4, ignore_eos=True)
    cfgs = [GenerationConfig(max_new_tokens=40 + 5 * i, seed=i, **settings) for i in range(4)]
    alone = [e.generate(p, c).token_ids for p, c in zip(prompts, cfgs, strict=True)]
    together = run_concurrently(e, [e.prepare(p, c) for p, c in zip(prompts, cfgs, strict=True)])
    assert [o.token_ids for o in together] == alone
    banks = e.target.model.static_slots.banks
    joined = [g for b in banks for k, g in b.graphs.items() if k[0] == "joined"]
    assert joined and sum(g.replays for g in joined) >= (40 if method == "ar" else 8)


def test_graphed_rounds_follow_the_steps_in_distribution(tmp_path):
    """On CUDA the fused rounds draw their uniforms in one call where the steps draw them one
    by one (Philox offsets differ), so tokens differ from ``steps``; what must agree is what
    they sample: exact SD at acceptance < 1 against the enumerated target is
    ``test_exact_sd_on_cuda_matches_the_target`` (which runs graphs by default). Here: every
    method generates to the budget with graphs and with steps."""
    d = [make_tiny_hf_model(tmp_path / str(s), "qwen2", seed=s) for s in (0, 1)]
    e = Engine(load_hf_dir(d[0], device="cuda", dtype="bfloat16"),
               load_hf_dir(d[1], device="cuda", dtype="bfloat16"))  # fmt: skip
    for mode in ("steps", "graphs"):
        for m in e.models().values():
            m.rounds = mode
        for method in ("ar", "sd", "smc"):
            r = e.generate([5, 6, 7], GenerationConfig(method=method, max_new_tokens=33, seed=1,
                                                      ignore_eos=True), chat=False)  # fmt: skip
            assert r.new_tokens == 33


def test_the_captured_prefill_matches_the_eager_one(tmp_path):
    """A static cache's prefill replayed as a CUDA graph (the prompt padded to its window)
    against the eager prefill of the same prompt: logits and prompt KV, bf16 tolerances."""
    model = load_hf_dir(make_tiny_hf_model(tmp_path, "llama", seed=0), device="cuda",
                        dtype="bfloat16").model  # fmt: skip
    prompt = torch.arange(3, 40, device="cuda")
    for _ in range(2):  # the second replays the graph the first captured
        static = model.new_cache(2, 8, static=True, prompt_len=37)
        got = model.prefill(prompt, static)
        static.close()
    assert static.graphs[("prefill", 64)].replays >= 1
    eager = model.new_cache(2, 8)
    want = model.prefill(prompt, eager)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(
        static.prefix_k.float(), eager.prefix_k.float(), rtol=2e-2, atol=2e-2
    )


@pytest.mark.parametrize("name", ["compiled", "flex", "layer"])
def test_kernel_sets_replay_in_graphs_like_the_written_ones(tmp_path, name):
    """Each compiled kernel set (Triton kernels: ``compiled`` the layer pieces one by one,
    ``flex`` the rounds' attention as one flex_attention kernel, ``layer`` each layer one
    compiled function) captured in the rounds' CUDA graphs: a static forward's logits within
    bf16 tolerance of the written kernels', and every method generating to the budget with
    it (the campaign's ``[compiled]``, ``[flex]``, ``[layer]`` rows), its graphs keyed by the
    set."""
    d = [make_tiny_hf_model(tmp_path / str(s), "llama", seed=s) for s in (0, 1)]
    e = Engine(load_hf_dir(d[0], device="cuda", dtype="bfloat16"),
               load_hf_dir(d[1], device="cuda", dtype="bfloat16"))  # fmt: skip
    target = e.target.model
    prompt = torch.arange(3, 40, device="cuda")
    tokens = torch.tensor([[5, 6], [7, 8]], device="cuda")
    start = torch.zeros((), dtype=torch.long, device="cuda")
    logits = {}
    target.rounds = "eager"
    for kernels in ("eager", name):
        target.use_kernels(kernels)
        cache = target.new_cache(2, 8, static=True, prompt_len=37)
        target.prefill(prompt, cache)
        logits[kernels] = target.decode_static(tokens, cache, start, 64).float()
        cache.close()
    torch.testing.assert_close(logits[name], logits["eager"], rtol=2e-2, atol=2e-2)
    target.release_static()
    for m in e.models().values():
        m.use_kernels(name)
        m.rounds = "graphs"
    for method in ("ar", "sd", "smc"):
        r = e.generate([5, 6, 7], GenerationConfig(method=method, max_new_tokens=33, seed=1,
                                                  ignore_eos=True), chat=False)  # fmt: skip
        assert r.new_tokens == 33
    graphs = [k for c in target.static_slots.slots for k in c.graphs]
    assert graphs and all(k[-1] == name for k in graphs)  # captured with them


def test_auto_runs_the_flex_attention_on_cuda(tmp_path):
    """The default kernel set on CUDA is ``flex`` (``kernels.auto_kernels``): a request's
    rounds run it, and no compile failure made it fall back."""
    from smcspec.backends.torch import kernels

    e = Engine(load_hf_dir(make_tiny_hf_model(tmp_path, "llama", seed=0), device="cuda",
                           dtype="bfloat16"))  # fmt: skip
    r = e.generate([5, 6, 7], GenerationConfig(method="ar", max_new_tokens=9), chat=False)
    assert r.new_tokens == 9 and e.target.model.kernels.name == "flex"
    assert not kernels._auto_failures


def test_fp8_weights_run_in_captured_rounds(tmp_path):
    """FP8 projections (CUTLASS's row-wise scaled GEMM on sm_90) against the bf16 model, and
    every method generating to the budget with them captured in graphs (the campaign's FP8
    rows). Skips on a GPU without FP8 GEMMs here (compute capability below 9.0)."""
    from smcspec.backends.torch.fp8 import convert_to_fp8, fp8_supported

    if not fp8_supported("cuda"):
        pytest.skip("this GPU has no FP8 GEMM")
    d = [make_tiny_hf_model(tmp_path / str(s), "llama", seed=s) for s in (0, 1)]
    e = Engine(load_hf_dir(d[0], device="cuda", dtype="bfloat16"),
               load_hf_dir(d[1], device="cuda", dtype="bfloat16"))  # fmt: skip
    target = e.target.model
    prompt = torch.arange(3, 40, device="cuda")

    def logits() -> torch.Tensor:
        cache = target.new_cache(2, 8)
        target.prefill(prompt, cache)
        return target.decode(torch.tensor([[5, 6], [7, 8]], device="cuda"), cache).float()

    bf16 = logits()
    for m in e.models().values():
        assert convert_to_fp8(m) > 0
        m.rounds = "graphs"
    fp8 = logits()
    assert (fp8 - bf16).abs().max() < 0.2 * (bf16.max() - bf16.min())  # CPU test: 0.085
    for method in ("ar", "sd", "smc"):
        r = e.generate([5, 6, 7], GenerationConfig(method=method, max_new_tokens=33, seed=1,
                                                  ignore_eos=True), chat=False)  # fmt: skip
        assert r.new_tokens == 33
    assert any(c.graphs for c in target.static_slots.slots)
