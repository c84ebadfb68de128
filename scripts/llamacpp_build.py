"""Which llama.cpp build ``scripts/build_llamacpp.sh`` (and ``build_llamacpp_libs.sh``) makes:
a pure function of the host. It sits beside the build scripts, not in the runtime package:
smcspec never imports it.

- **CUDA** where ``nvidia-smi`` (a driver) and ``nvcc`` (a toolkit to compile with) are both
  found: ``-DGGML_CUDA=ON``; the CPU code is still built for the CPU found. The kernels are
  compiled for the cards found (``-DCMAKE_CUDA_ARCHITECTURES=90`` on an H100 or H200, the
  distinct ones joined with ``;``), which cuts the compile to one architecture; where
  ``nvidia-smi`` does not say, the flag is left out and llama.cpp's default list applies.
- **Metal** on macOS arm64 (Apple Silicon): ``-DGGML_METAL=ON``.
- **CPU** otherwise, as before: never ``GGML_NATIVE`` (its build crashed with SIGILL on an
  AMX CPU), the x86 instruction sets read from ``/proc/cpuinfo``'s flags, AMX off.
- **RPC** in every build (``-DGGML_RPC=ON``): llama.cpp's ``rpc-server`` protocol, to spread
  a target over machines.

``python scripts/llamacpp_build.py`` prints the accelerator on the first line and
the CMake arguments on the second (what the script reads). Flags follow llama.cpp's
``docs/build.md`` (``GGML_CUDA``, ``GGML_METAL``, ``GGML_RPC``, and ``CMAKE_CUDA_ARCHITECTURES``
from the cards' compute capabilities, "Override Compute Capability Specifications") and
``ggml/CMakeLists.txt``.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
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
    (``platform.system()``), the architecture (``platform.machine()``), whether
    ``nvidia-smi`` and ``nvcc`` are on the PATH, and the cards' CUDA architectures
    (``cuda_archs``: CMake's spelling, ``"90"`` for compute capability 9.0; distinct,
    ascending; empty where unknown or without ``nvidia-smi``)."""

    cpu_flags: frozenset[str]
    system: str
    machine: str
    nvidia_smi: bool
    nvcc: bool
    cuda_archs: tuple[str, ...] = ()


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
        args.append("-DGGML_CUDA=ON")
        if host.cuda_archs:
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(host.cuda_archs)}")
        return BuildPlan("cuda", tuple(args))
    return BuildPlan("cpu", tuple(args))


def parse_compute_caps(text: str) -> tuple[str, ...]:
    """The CMake CUDA architectures in the output of
    ``nvidia-smi --query-gpu=compute_cap --format=csv,noheader`` (one ``major.minor`` line a
    card: ``"9.0"`` gives ``"90"``, ``"12.0"`` gives ``"120"``), distinct and ascending.

    Empty when any card's line is not a compute capability (``[N/A]``, an error message) or
    there is none: building for only the cards that answered would leave the others without
    kernels, and llama.cpp's default list covers every card.
    """
    archs: set[tuple[int, int]] = set()
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        major, dot, minor = line.partition(".")
        if not (dot and major.isdigit() and minor.isdigit()):
            return ()
        archs.add((int(major), int(minor)))
    return tuple(f"{major}{minor}" for major, minor in sorted(archs))


def _cuda_archs() -> tuple[str, ...]:
    """This machine's cards' CUDA architectures (:func:`parse_compute_caps` of
    ``nvidia-smi``'s answer); empty without ``nvidia-smi``, or when it fails or takes over
    30 s."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        out = subprocess.run(
            [smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ()
    return parse_compute_caps(out)


def detect_host(cpuinfo: Path = Path("/proc/cpuinfo")) -> BuildHost:
    """This machine's :class:`BuildHost`: ``cpuinfo``'s first ``flags`` line (none where the
    file cannot be read), and the cards' architectures from ``nvidia-smi`` (see
    :func:`parse_compute_caps`)."""
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
        cuda_archs=_cuda_archs(),
    )


if __name__ == "__main__":
    plan = build_plan(detect_host())
    print(plan.accelerator)
    print(" ".join(plan.cmake_args))
