"""Which llama.cpp build ``scripts/build_llamacpp.sh`` makes: a pure function of the host.

- **CUDA** where ``nvidia-smi`` (a driver) and ``nvcc`` (a toolkit to compile with) are both
  found: ``-DGGML_CUDA=ON``; the CPU code is still built for the CPU found.
- **Metal** on macOS arm64 (Apple Silicon): ``-DGGML_METAL=ON``.
- **CPU** otherwise, as before: never ``GGML_NATIVE`` (its build crashed with SIGILL on an
  AMX CPU), the x86 instruction sets read from ``/proc/cpuinfo``'s flags, AMX off.
- **RPC** in every build (``-DGGML_RPC=ON``): llama.cpp's ``rpc-server`` protocol, to spread
  a target over machines.

``python -m smcspec.backends.llamacpp_build`` prints the accelerator on the first line and
the CMake arguments on the second (what the script reads). Flags follow llama.cpp's
``docs/build.md`` (``GGML_CUDA``, ``GGML_METAL``, ``GGML_RPC``) and ``ggml/CMakeLists.txt``.
"""

from __future__ import annotations

import platform
import shutil
from dataclasses import dataclass
from pathlib import Path

# ggml's x86 options and the /proc/cpuinfo flag that says the CPU has the instructions
X86_FLAGS = (
    ("GGML_AVX", "avx"),
    ("GGML_AVX2", "avx2"),
    ("GGML_FMA", "fma"),
    ("GGML_F16C", "f16c"),
    ("GGML_BMI2", "bmi2"),
    ("GGML_AVX_VNNI", "avx_vnni"),
    ("GGML_AVX512", "avx512f"),
    ("GGML_AVX512_VBMI", "avx512vbmi"),
    ("GGML_AVX512_VNNI", "avx512_vnni"),
    ("GGML_AVX512_BF16", "avx512_bf16"),
)
ALWAYS = (
    "-DGGML_NATIVE=OFF",
    "-DGGML_RPC=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
)


@dataclass(frozen=True)
class BuildHost:
    """What the build looks at: the CPU's flags (``/proc/cpuinfo``; empty off Linux), the OS
    (``platform.system()``), the architecture (``platform.machine()``), and whether
    ``nvidia-smi`` and ``nvcc`` are on the PATH."""

    cpu_flags: frozenset[str]
    system: str
    machine: str
    nvidia_smi: bool
    nvcc: bool


@dataclass(frozen=True)
class BuildPlan:
    """``accelerator``: ``cpu``, ``cuda`` or ``metal``; ``cmake_args``: the CMAKE_ARGS."""

    accelerator: str
    cmake_args: tuple[str, ...]


def build_plan(host: BuildHost) -> BuildPlan:
    """The build for ``host`` (see the module docstring)."""
    args = list(ALWAYS)
    if host.system == "Darwin" and host.machine == "arm64":
        return BuildPlan("metal", (*args, "-DGGML_METAL=ON"))
    if host.machine in ("x86_64", "AMD64", "i686"):
        args += [f"-D{opt}={'ON' if flag in host.cpu_flags else 'OFF'}" for opt, flag in X86_FLAGS]
        args += ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    if host.nvidia_smi and host.nvcc:
        return BuildPlan("cuda", (*args, "-DGGML_CUDA=ON"))
    return BuildPlan("cpu", tuple(args))


def detect_host(cpuinfo: Path = Path("/proc/cpuinfo")) -> BuildHost:
    """This machine's :class:`BuildHost`."""
    flags: frozenset[str] = frozenset()
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = frozenset(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return BuildHost(
        cpu_flags=flags,
        system=platform.system(),
        machine=platform.machine(),
        nvidia_smi=shutil.which("nvidia-smi") is not None,
        nvcc=shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists(),
    )


if __name__ == "__main__":
    plan = build_plan(detect_host())
    print(plan.accelerator)
    print(" ".join(plan.cmake_args))
