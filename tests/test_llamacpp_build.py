"""The llama.cpp build chosen from faked hosts (``scripts/llamacpp_build.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "llamacpp_build.py"
sys.path.insert(0, str(SCRIPT.parent))
import llamacpp_build as build  # noqa: E402  (beside the build scripts, not in the package)
from llamacpp_build import BuildHost, build_plan, detect_host, parse_compute_caps  # noqa: E402

AVX2_HOST = frozenset({"fpu", "avx", "avx2", "fma", "f16c", "bmi2"})
AMX_HOST = AVX2_HOST | {"avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8"}


def host(flags=AVX2_HOST, system="Linux", machine="x86_64", smi=False, nvcc=False, archs=()):
    return BuildHost(frozenset(flags), system, machine, smi, nvcc, tuple(archs))


def args_of(plan) -> dict[str, str]:
    return dict(a.removeprefix("-D").split("=", 1) for a in plan.cmake_args)


def test_a_cpu_host_builds_for_its_instruction_sets_with_rpc():
    plan = build_plan(host())
    a = args_of(plan)
    assert plan.accelerator == "cpu"
    assert a["GGML_NATIVE"] == "OFF" and a["GGML_RPC"] == "ON"
    assert a["GGML_AVX2"] == "ON" and a["GGML_AVX512"] == "OFF"
    assert "GGML_CUDA" not in a and "GGML_METAL" not in a


def test_amx_stays_off_even_where_the_cpu_has_it():
    a = args_of(build_plan(host(AMX_HOST)))
    assert a["GGML_AVX512"] == a["GGML_AVX512_BF16"] == "ON"
    assert a["GGML_AMX_TILE"] == a["GGML_AMX_INT8"] == a["GGML_AMX_BF16"] == "OFF"


@pytest.mark.parametrize("smi, nvcc, accelerator", [
    (True, True, "cuda"),
    (True, False, "cpu"),  # a driver without a toolkit cannot compile CUDA code
    (False, True, "cpu"),  # a toolkit without a GPU
])  # fmt: skip
def test_cuda_needs_a_driver_and_a_toolkit(smi, nvcc, accelerator):
    plan = build_plan(host(smi=smi, nvcc=nvcc))
    a = args_of(plan)
    assert plan.accelerator == accelerator
    assert (a.get("GGML_CUDA") == "ON") == (accelerator == "cuda")
    assert a["GGML_RPC"] == "ON" and a["GGML_AVX2"] == "ON"  # the CPU side still fits the CPU


def test_an_h100_host_builds_cuda_for_its_architecture_only():
    plan = build_plan(host(smi=True, nvcc=True, archs=parse_compute_caps("9.0\n")))
    a = args_of(plan)
    assert plan.accelerator == "cuda" and a["GGML_CUDA"] == "ON"
    assert a["CMAKE_CUDA_ARCHITECTURES"] == "90"
    assert a["GGML_RPC"] == "ON" and a["GGML_AVX2"] == "ON"


def test_two_different_cards_get_both_architectures():
    archs = parse_compute_caps("9.0\n8.6\n9.0\n")
    a = args_of(build_plan(host(smi=True, nvcc=True, archs=archs)))
    assert a["CMAKE_CUDA_ARCHITECTURES"] == "86;90"


def test_a_driver_without_a_toolkit_builds_for_the_cpu_whatever_the_card():
    plan = build_plan(host(smi=True, nvcc=False, archs=("90",)))
    assert plan.accelerator == "cpu"
    assert not any(k.startswith(("GGML_CUDA", "CMAKE_CUDA")) for k in args_of(plan))


def test_an_unknown_card_leaves_llama_cpps_default_architectures():
    plan = build_plan(host(smi=True, nvcc=True, archs=()))
    a = args_of(plan)
    assert plan.accelerator == "cuda" and a["GGML_CUDA"] == "ON"
    assert "CMAKE_CUDA_ARCHITECTURES" not in a


@pytest.mark.parametrize("text, archs", [
    ("9.0\n", ("90",)),  # H100, H200
    ("9.0\n9.0\n", ("90",)),  # one architecture per kind of card
    ("12.0\n8.6\n", ("86", "120")),  # ascending, two-digit majors
    ("  8.9 \r\n\n", ("89",)),  # blanks and CRLF around
    ("", ()),  # no card
    ("[N/A]\n", ()),  # the driver does not say
    ("9.0\n[N/A]\n", ()),  # one card unknown: building for the other alone would miss it
    ("Failed to initialize NVML: Driver/library version mismatch\n", ()),
    ("9\n", ()),
])  # fmt: skip
def test_parse_compute_caps(text, archs):
    assert parse_compute_caps(text) == archs


def test_detect_host_without_nvidia_smi_knows_no_architecture(monkeypatch):
    real_which = build.shutil.which
    monkeypatch.setattr(
        build.shutil, "which", lambda name: None if name == "nvidia-smi" else real_which(name)
    )
    found = detect_host()
    assert not found.nvidia_smi and found.cuda_archs == ()


def test_detect_host_asks_nvidia_smi_for_the_compute_capability(monkeypatch, tmp_path):
    smi = tmp_path / "nvidia-smi"  # a fake that answers like a host with two H100s
    smi.write_text('#!/bin/sh\n[ "$1" = --query-gpu=compute_cap ] && printf "9.0\\n9.0\\n"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    found = detect_host()
    assert found.nvidia_smi and found.cuda_archs == ("90",)


def test_apple_silicon_builds_metal_without_x86_flags():
    plan = build_plan(host(frozenset(), system="Darwin", machine="arm64"))
    a = args_of(plan)
    assert plan.accelerator == "metal" and a["GGML_METAL"] == "ON" and a["GGML_RPC"] == "ON"
    assert not any(k.startswith("GGML_AVX") for k in a)


def test_linux_arm_builds_for_the_cpu_without_x86_flags():
    plan = build_plan(host(frozenset({"neon"}), machine="aarch64"))
    assert plan.accelerator == "cpu"
    assert not any(k.startswith("GGML_AVX") for k in args_of(plan))


def test_detect_host_reads_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags\t\t: fpu avx avx2\n\nprocessor : 1\nflags : fpu\n")
    assert detect_host(info).cpu_flags == frozenset({"fpu", "avx", "avx2"})
    assert detect_host(tmp_path / "missing").cpu_flags == frozenset()


def test_the_command_prints_what_the_build_script_reads():
    out = subprocess.run(
        [sys.executable, str(SCRIPT)],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert out[0] in ("cpu", "cuda", "metal") and "-DGGML_RPC=ON" in out[1].split()


# ------------------------------------------------------------------ using the build's devices
@pytest.mark.parametrize("gpus, backend, device, expected", [
    ([], "auto", "cpu", "llamacpp"),
    ([], "auto", "cuda", "torch"),  # a CPU build cannot run the GGUF on the GPU
    (["CUDA0"], "auto", "cuda", "llamacpp"),
    (["CUDA0"], "llamacpp", "cuda:0", "llamacpp"),
])  # fmt: skip
def test_auto_picks_llamacpp_where_its_build_runs(monkeypatch, tmp_path, gpus, backend, device,
                                                 expected):  # fmt: skip
    import importlib.util

    import smcspec.models.loading as loading

    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    monkeypatch.setattr(loading, "llamacpp_gpus", lambda: gpus)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert loading.resolve_backend(backend, gguf, device) == expected


def test_llamacpp_on_a_gpu_its_build_does_not_see_is_refused(monkeypatch, tmp_path):
    import smcspec.models.loading as loading
    from smcspec.errors import ConfigError

    monkeypatch.setattr(loading, "llamacpp_gpus", lambda: [])
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="sees no GPU"):
        loading.resolve_backend("llamacpp", gguf, "cuda")


def test_offloaded_settings_key_their_costs_apart():
    from smcspec.backends.llamacpp import LlamaCppSettings

    assert LlamaCppSettings().offload() is None  # CPU only: the old cost key, unchanged
    assert LlamaCppSettings(gpu_layers=-1).offload() == "gpu_layers=-1;rpc="
    rpc = LlamaCppSettings(gpu_layers=-1, rpc_servers=("h:1", "h:2")).offload()
    assert rpc == "gpu_layers=-1;rpc=h:1,h:2"


def test_cuda_graphs_are_off_where_layers_are_offloaded():
    """The H200's graph-replay abort (docs/gpu.md): offloaded models ask llama.cpp for no
    CUDA graphs unless told otherwise; CPU-only models set nothing."""
    from smcspec.backends.llamacpp import LlamaCppSettings

    assert LlamaCppSettings().environment() == {}
    assert LlamaCppSettings(gpu_layers=-1).environment() == {"GGML_CUDA_DISABLE_GRAPHS": "1"}
    assert LlamaCppSettings(gpu_layers=4, cuda_graphs=True).environment() == {}


def test_logits_device_is_checked_before_anything_loads():
    """``logits_device``: the CPU by default; a GPU only where PyTorch sees one; anything
    else refused by name (ConfigError, before llama.cpp is touched)."""
    import torch

    from smcspec.backends.llamacpp import LlamaCppSettings
    from smcspec.errors import ConfigError

    LlamaCppSettings().validate(256)
    with pytest.raises(ConfigError, match="cpu or cuda"):
        LlamaCppSettings(logits_device="gpu").validate(256)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            LlamaCppSettings(logits_device="cuda:0").validate(256)


def test_the_cost_key_names_what_is_offloaded(tmp_path):
    from types import SimpleNamespace

    import torch

    from smcspec.tuning.cache import cost_key

    f = tmp_path / "t.gguf"
    f.write_bytes(b"x")

    def pair(offload):
        model = SimpleNamespace(device=torch.device("cpu"), threads=2, offload=offload)
        side = SimpleNamespace(model=model, backend="llamacpp", path=f)
        return SimpleNamespace(target=side, draft=side)

    cpu, gpu = cost_key(pair(None), 64), cost_key(pair("gpu_layers=-1;rpc="), 64)
    assert "offload" not in cpu  # CPU-only keys (and their cached costs) are unchanged
    assert gpu["offload"] == ["gpu_layers=-1;rpc=", "gpu_layers=-1;rpc="]
