"""The llamacpp backend on a GPU build (CUDA or Metal, chosen by ``scripts/setup.sh``).

Skipped wherever llama.cpp sees no GPU device: CI and the CPU machines this project has run
on, so these have not run yet. On a GPU machine: ``pytest -m gpu``. They check that layers
offloaded with ``gpu_layers`` give the CPU's logits, that every method decodes there, and
that exact SD on the GPU still samples the target's enumerated distribution.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from enumerable import chisquare_p, total_variation
from test_statistical_llamacpp import LENGTH, PROMPT, SD_CFG, V, _sample, exact_log_probs
from tiny_models import make_tiny_gguf

from smcspec.config import GenerationConfig
from smcspec.decoding import decode_ar, decode_sd, decode_smc
from smcspec.errors import ConfigError

pytestmark = pytest.mark.gpu
pytest.importorskip("llama_cpp")
from smcspec.backends.llamacpp import LlamaCppModel, LlamaCppSettings  # noqa: E402
from smcspec.backends.llamacpp.rpc import gpu_devices  # noqa: E402

try:
    DEVICES = gpu_devices()
except ConfigError:
    DEVICES = []
if not DEVICES:
    pytest.skip("llama.cpp sees no GPU device in this build", allow_module_level=True)

CPU = LlamaCppSettings(threads=1, kv_cells=1024, kv_type="f32", max_sequences=64, n_batch=256)
GPU = LlamaCppSettings(**{**CPU.__dict__, "gpu_layers": -1})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    target_file = make_tiny_gguf(root, "qwen2", V, seed=1, num_hidden_layers=2)[0]
    draft_file = make_tiny_gguf(root, "qwen2", V, seed=2, num_hidden_layers=1)[0]
    cpu = LlamaCppModel(target_file, CPU)
    gpu = LlamaCppModel(target_file, GPU)
    draft = LlamaCppModel(draft_file, GPU)
    yield cpu, gpu, draft
    for m in (gpu, draft):
        m.release()


def test_offloaded_logits_equal_cpu_logits(models):
    cpu, gpu, _ = models
    assert gpu.offload and cpu.offload is None, (DEVICES, gpu.offload)
    ids = torch.tensor([3, 1, 2, 0, 1])
    rows = torch.tensor([[1, 2, 3], [0, 0, 1], [3, 3, 3]])
    out = []
    for model in (cpu, gpu):
        cache = model.new_cache(3, 8)
        out.append((model.prefill(ids, cache), model.decode(rows, cache)))
    # other kernels (cuBLAS/Metal, f16 accumulation in places): the llamacpp tests' 5e-2 bound
    torch.testing.assert_close(out[1][0], out[0][0], atol=5e-2, rtol=0)
    torch.testing.assert_close(out[1][1], out[0][1], atol=5e-2, rtol=0)


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_every_method_decodes_on_the_gpu(models, method):
    _, gpu, draft = models
    cfg = GenerationConfig(method=method, max_new_tokens=12, particles=8, draft_tokens=3)
    decode = {"ar": decode_ar, "sd": decode_sd, "smc": decode_smc}[method]
    pair = (gpu,) if method == "ar" else (gpu, draft)
    out = decode(*pair, PROMPT, cfg, frozenset(), V, torch.Generator().manual_seed(0))
    assert len(out.tokens) >= 12 and all(0 <= t < V for t in out.tokens)


def test_exact_sd_on_the_gpu_matches_the_target(models):
    cpu, gpu, draft = models
    exact = exact_log_probs(cpu)  # enumerated on the CPU: the GPU target must sample it
    runs = 1000
    counts = _sample(decode_sd, gpu, draft, SD_CFG, runs)
    assert sum(counts.values()) == runs and all(len(k) == LENGTH for k in counts)
    # chi-square over the 64 sequences, p-value bound 1e-3; TV at 1000 runs' noise (~0.1)
    assert chisquare_p(exact, counts, runs) > 1e-3
    assert total_variation(exact, counts, runs) < 0.15


needs_torch_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="PyTorch sees no CUDA device (logits_device='cuda')"
)


@needs_torch_cuda
def test_logits_on_the_torch_gpu_equal_host_logits(models, tmp_path):
    cpu, gpu, _ = models
    on_cuda = LlamaCppModel(gpu.path, replace(GPU, logits_device="cuda"))
    try:
        assert on_cuda.device.type == "cuda"
        ids = torch.tensor([3, 1, 2, 0, 1])
        rows = torch.tensor([[1, 2, 3], [0, 0, 1], [1, 2, 3]])  # rows 0 and 2 share a row
        out = []
        for model in (gpu, on_cuda):
            cache = model.new_cache(3, 8)
            first = model.prefill(ids, cache)
            out.append((first.clone(), model.decode(rows, cache).clone()))
            cache.close()
        assert out[1][0].device.type == "cuda" and out[1][1].device.type == "cuda"
        torch.testing.assert_close(out[1][0].cpu(), out[0][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(out[1][1].cpu(), out[0][1], atol=1e-5, rtol=0)
    finally:
        on_cuda.release()


@needs_torch_cuda
@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_every_method_samples_on_the_torch_gpu(models, method):
    _, gpu, draft = models
    cuda = replace(GPU, logits_device="cuda")
    pair = [LlamaCppModel(gpu.path, cuda), LlamaCppModel(draft.path, cuda)]
    try:
        cfg = GenerationConfig(method=method, max_new_tokens=12, particles=8, draft_tokens=3)
        decode = {"ar": decode_ar, "sd": decode_sd, "smc": decode_smc}[method]
        models_ = pair[:1] if method == "ar" else pair
        g = torch.Generator(device="cuda").manual_seed(0)
        out = decode(*models_, PROMPT, cfg, frozenset(), V, g)
        assert len(out.tokens) >= 12 and all(0 <= t < V for t in out.tokens)
    finally:
        for m in pair:
            m.release()
