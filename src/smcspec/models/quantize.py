"""A cheaper draft: a GGUF draft re-quantized once to a smaller llama.cpp type, cached.

The draft's forwards are a large part of a speculative round's cost (K of them a round), so
a smaller type (e.g. ``Q4_0`` instead of ``Q8_0``) makes rounds cheaper; the acceptance rate
may drop a little. The file is made by llama.cpp's ``llama_model_quantize``
(:func:`quantize_gguf`) into
``$SMCSPEC_CACHE/quantized/<stem>-<source id>-<TYPE>.gguf``, where the source id hashes the
source's resolved path, size and modification time, so a changed source is quantized again.

Only the ``llamacpp`` backend gains from it: the ``torch`` backend dequantizes GGUF weights
to floating point, so a re-quantized draft would compute as slowly there (and only lose
accuracy); it is refused.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Callable
from pathlib import Path

from smcspec.errors import ConfigError, ModelFileError

# llama.cpp's quantization types (ftype ids) offered for a cheaper draft
QUANT_TYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_K_S": 14, "Q4_K_M": 15, "Q3_K_M": 12, "Q2_K": 10}


def quantize_gguf(src: Path, dst: Path, kind: str, threads: int | None = None) -> Path:
    """Re-quantize ``src`` to llama.cpp type ``kind`` (e.g. ``Q4_0``) into ``dst``, once.

    Raises:
        ConfigError: unknown type; ModelFileError: llama.cpp failed.
    """
    if kind not in QUANT_TYPES:
        raise ConfigError(f"unknown quantization {kind!r}; choose from {', '.join(QUANT_TYPES)}")
    if dst.is_file():
        return dst
    from smcspec.backends.llamacpp.lib import library
    from smcspec.backends.llamacpp.settings import physical_cores

    lib = library()
    params = lib.llama_model_quantize_default_params()
    params.ftype = QUANT_TYPES[kind]
    params.nthread = threads or physical_cores()
    params.allow_requantize = True  # the source may itself be quantized (Q8_0, ...)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    rc = lib.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise ModelFileError(f"llama.cpp could not quantize {src} to {kind} (code {rc})")
    tmp.rename(dst)
    return dst


def quantize_types() -> tuple[str, ...]:
    """The llama.cpp types a draft can be re-quantized to (``Q8_0``, ``Q4_0``, ...)."""
    return tuple(QUANT_TYPES)


def quantized_path(src: Path, kind: str, root: Path) -> Path:
    """Where the ``kind`` re-quantization of GGUF ``src`` is cached under ``root``."""
    st = src.stat()
    ident = hashlib.sha256(f"{src.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return root / "quantized" / f"{src.stem}-{ident.hexdigest()[:12]}-{kind}.gguf"


def requantized_draft(
    src: Path,
    kind: str,
    root: Path,
    backend: str,
    threads: int | None = None,
    log: Callable[[str], None] | None = None,
) -> Path:
    """The GGUF file ``src`` re-quantized to llama.cpp type ``kind``, made on first use.

    Args:
        src: the draft's GGUF file.
        kind: a type of :func:`quantize_types`.
        root: the cache directory (``$SMCSPEC_CACHE``).
        backend: the backend the draft will run on (resolved: ``llamacpp`` or ``torch``).
        threads: quantization threads (default: the physical cores).
        log: called with one line before the file is made (it takes seconds to minutes).
    Raises:
        ConfigError: unknown type, a draft that is not a GGUF file, or the torch backend.
        ModelFileError: llama.cpp cannot quantize the file.
    """
    if kind not in quantize_types():
        raise ConfigError(
            f"unknown quantization {kind!r}; choose from {', '.join(quantize_types())}"
        )
    if not src.is_file():
        raise ConfigError(f"--quantize-draft needs a GGUF draft file; {src} is not a file")
    if backend != "llamacpp":
        raise ConfigError(
            "--quantize-draft makes a cheaper draft for the llamacpp backend; the torch "
            "backend dequantizes GGUF weights, so it would run no faster (use --backend "
            "llamacpp, on the CPU)"
        )
    dst = quantized_path(src, kind, root)
    if not dst.is_file():
        if log is not None:
            log(f"re-quantizing the draft {src.name} to {kind} once: {dst}")
        quantize_gguf(src, dst, kind, threads)
    return dst
