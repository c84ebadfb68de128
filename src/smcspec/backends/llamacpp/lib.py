"""llama.cpp's C API, loaded once per process: the low-level ``llama_cpp`` module of
``llama-cpp-python``, its backends initialised and its log silenced but for errors."""

from __future__ import annotations

import ctypes
import sys
import threading

from smcspec.errors import ConfigError

_INIT_LOCK = threading.Lock()
_INITIALISED = False
_LOG_CALLBACK = None  # llama.cpp's log callback (logs silenced), made on first use


def library():
    """The low-level ``llama_cpp`` module, with the backend initialised and its log silenced but
    for errors.

    Raises:
        ConfigError: llama-cpp-python is not installed.
    """
    global _INITIALISED, _LOG_CALLBACK
    try:
        import llama_cpp
    except ImportError as exc:
        raise ConfigError(
            "the llamacpp backend needs llama-cpp-python (scripts/setup.sh builds it for this "
            "CPU); or use --backend torch"
        ) from exc
    with _INIT_LOCK:
        if not _INITIALISED:
            # the callback object must outlive every llama.cpp call: kept in the module
            _LOG_CALLBACK = llama_cpp.llama_log_callback(_errors_only)
            llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p())
            llama_cpp.llama_backend_init()
            _INITIALISED = True
    return llama_cpp


GGML_LOG_LEVEL_ERROR = 4  # ggml.h: NONE, DEBUG, INFO, WARN, ERROR, CONT


def _errors_only(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp's log, silenced but for its errors (e.g. the CUDA error printed just before
    an abort), which go to stderr."""
    if level == GGML_LOG_LEVEL_ERROR:
        sys.stderr.write(text.decode("utf-8", "replace"))
