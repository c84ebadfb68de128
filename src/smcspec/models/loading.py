"""Load a model from a Hugging Face directory or a GGUF file, on the backend that runs it.

The ``llamacpp`` backend runs a GGUF file as it is (:mod:`smcspec.backends.llamacpp`). For
the ``torch`` backend a GGUF file is converted once into a Hugging Face-style directory in
the cache (:mod:`smcspec.models.gguf_convert`: ``config.json``, ``model.safetensors`` with
dequantized float32 weights, tokenizer files with the chat template), and every later start
loads that directory (:mod:`smcspec.backends.torch.weights`). Tokenizers come from
``transformers`` on both backends, so both see the same token ids; the draft of a llamacpp
pair is loaded without one (``tokenizer=False``: the target's serves the pair).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from smcspec.backends.base import LoadedModel  # noqa: F401  (re-exported)
from smcspec.errors import ModelFileError

if TYPE_CHECKING:
    from smcspec.backends.llamacpp import LlamaCppSettings

BACKENDS = ("auto", "torch", "llamacpp")


def cache_root() -> Path:
    """``$SMCSPEC_CACHE`` or ``~/.cache/smcspec``."""
    return Path(os.environ.get("SMCSPEC_CACHE") or Path.home() / ".cache" / "smcspec")


def resolve_backend(backend: str, path: Path, device: str | torch.device) -> str:
    """``auto`` -> ``llamacpp`` for a GGUF file when llama-cpp-python is installed and runs
    on ``device`` (the CPU, or a GPU its build sees), else ``torch``. Raises
    :class:`ConfigError` for a backend that cannot run it.
    """
    from smcspec.errors import ConfigError

    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    on_cpu = str(device) == "cpu"
    if backend == "auto":
        import importlib.util

        has_llamacpp = importlib.util.find_spec("llama_cpp") is not None
        runs = has_llamacpp and (on_cpu or bool(llamacpp_gpus()))
        return "llamacpp" if path.is_file() and runs else "torch"
    if backend == "llamacpp" and not path.is_file():
        raise ConfigError(f"the llamacpp backend runs GGUF files; {path} is a directory")
    if backend == "llamacpp" and not on_cpu and not llamacpp_gpus():
        raise ConfigError(
            f"the llama.cpp build installed here sees no GPU for --device {device}: "
            "scripts/setup.sh builds it with CUDA where nvidia-smi and nvcc are found "
            "(Metal on Apple Silicon); or use --backend torch"
        )
    return backend


def llamacpp_gpus() -> list[str]:
    """The GPU devices of the installed llama.cpp build (none without llama-cpp-python)."""
    try:
        from smcspec.backends.llamacpp.rpc import gpu_devices

        return gpu_devices()
    except Exception:  # llama-cpp-python missing or unloadable: no GPU through it
        return []


LLAMACPP_FIX = (
    "bash scripts/setup.sh builds it for this CPU (pip install 'smcspec[llamacpp]' compiles it "
    "natively, which crashed on some CPUs)"
)


def torch_fallback_notice(path: Path, device: str | torch.device) -> str | None:
    """The line to show when ``--backend auto`` sends the GGUF file ``path`` to the torch
    backend on the CPU only because llama-cpp-python is missing (None otherwise): what
    happens instead (a float32 conversion of the stated size, about a third of the speed)
    and the fix."""
    import importlib.util

    if str(device) != "cpu" or not path.is_file() or importlib.util.find_spec("llama_cpp"):
        return None
    size = ""
    try:
        from gguf import GGUFReader

        elements = sum(int(t.n_elements) for t in GGUFReader(str(path)).tensors)
        size = f" (about {elements * 4 / 1e9:.1f} GB, once, in {cache_root()})"
    except Exception:  # the size is a courtesy: an unreadable file fails properly later
        pass
    return (
        f"llama-cpp-python is not installed, so {path.name} runs on the torch backend: "
        f"dequantized to float32{size}, at about a third of the llamacpp backend's speed; "
        f"{LLAMACPP_FIX}"
    )


def load_model(
    path: str | os.PathLike,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    sha256: str | None = None,
    backend: str = "auto",
    llamacpp: LlamaCppSettings | None = None,
    tokenizer: bool = True,
) -> LoadedModel:
    """Load a GGUF file or a Hugging Face directory on a backend.

    Args:
        path: a ``.gguf`` file or a directory with ``config.json``, ``*.safetensors`` and
            ``tokenizer.json``.
        dtype: weight/compute dtype of the torch backend (``float32`` default; ``bfloat16``
            for GPUs); the llamacpp backend computes with the file's own types.
        device: ``cpu`` or ``cuda[:i]``.
        sha256: for a GGUF file, its known SHA-256 (skips hashing it again for the cache key).
        backend: ``auto`` (see :func:`resolve_backend`), ``torch`` or ``llamacpp``.
        llamacpp: settings of the llamacpp backend (threads, KV cells, sequences).
        tokenizer: False skips the tokenizer of a model run by llamacpp (writing its files
            from the GGUF metadata takes about 11 s once, loading it about 1 s a start); the
            torch backend always loads one.
    Raises:
        ModelFileError: missing, truncated or unsupported files. ConfigError: a backend
        that cannot run this file here.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFileError(f"model path does not exist: {p}")
    from smcspec.models.fitted_draft import is_fitted_draft

    if p.is_dir() and is_fitted_draft(p):
        return _load_fitted(p, dtype, device, backend, llamacpp, tokenizer)
    name = p.stem if p.is_file() else p.name
    if resolve_backend(backend, p, device) == "llamacpp":
        return _load_llamacpp(p, sha256, llamacpp, tokenizer)
    from smcspec.backends.torch.weights import load_hf_dir

    if p.is_file():
        from smcspec.models.gguf_convert import converted_dir

        p = converted_dir(p, cache_root(), sha256=sha256)
    loaded = load_hf_dir(p, dtype, device)
    loaded.name = name
    return loaded


def _load_fitted(
    folder: Path, dtype, device, backend: str, llamacpp, tokenizer: bool
) -> LoadedModel:
    """A fitted draft (:mod:`smcspec.models.fitted_draft`): its base GGUF with the LoRA
    adapter applied by llama.cpp, or the merged Hugging Face folder on the torch backend."""
    from dataclasses import replace

    from smcspec.backends.llamacpp import LlamaCppSettings
    from smcspec.models.fitted_draft import adapter_path, base_path, merged_hf_dir, read_manifest

    manifest = read_manifest(folder)
    base = base_path(manifest, cache_root())
    sha = manifest["base"]["sha256"]
    if resolve_backend(backend, base, device) == "llamacpp":
        settings = replace(llamacpp or LlamaCppSettings(),
                           lora=str(adapter_path(folder, manifest)))  # fmt: skip
        loaded = _load_llamacpp(base, sha if base.is_file() else None, settings, tokenizer)
    else:
        from smcspec.backends.torch.weights import load_hf_dir

        loaded = load_hf_dir(merged_hf_dir(folder, manifest, cache_root()), dtype, device)
    loaded.name = manifest.get("name", folder.name)
    loaded.path = folder
    return loaded


def _load_llamacpp(path: Path, sha256: str | None, settings, with_tokenizer: bool) -> LoadedModel:
    from smcspec.backends.llamacpp import LlamaCppModel

    tok = gguf_tokenizer(path, sha256) if with_tokenizer else None
    model = LlamaCppModel(path, settings)
    return LoadedModel(
        model=model,
        tokenizer=tok,
        path=path,
        config=None,
        name=path.stem,
        backend="llamacpp",
        vocab_size=model.n_vocab,
        context_length=model.context_length,
    )


def gguf_tokenizer(path: Path, sha256: str | None = None):
    """The ``transformers`` tokenizer of a GGUF file: its files are written once from the
    GGUF metadata into ``$SMCSPEC_CACHE/tokenizers/`` and loaded from there.

    Raises:
        ModelFileError: the file's tokenizer cannot be read or loaded.
    """
    from transformers import AutoTokenizer

    from smcspec.models.gguf_convert import tokenizer_dir

    tok_dir = tokenizer_dir(path, cache_root(), sha256=sha256)
    try:
        return AutoTokenizer.from_pretrained(str(tok_dir))
    except Exception as exc:
        raise ModelFileError(f"cannot load the tokenizer of {path}: {exc}") from exc
