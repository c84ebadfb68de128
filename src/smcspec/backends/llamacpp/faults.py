"""llama.cpp's fatal errors, seen before the process ends.

ggml stops the process on errors it cannot return (``GGML_ABORT``: an RPC server that
disappears mid-forward, ``RPC_STATUS_ASSERT`` in ``ggml-rpc.cpp``; a CUDA error in
``ggml-cuda``). ``ggml_abort`` formats the message, calls the callback installed with
``ggml_set_abort_callback`` (``ggml.h``) when there is one, and then calls ``abort()``
whatever the callback did (``ggml/src/ggml.c``). :func:`on_abort` installs a Python
function there, so a server can fail its requests with an error, turn ``/health`` to 503 and
exit with a status of its choice (the function may end the process itself, e.g. with
``os._exit``), instead of vanishing mid-response.

The callback runs on the thread that aborted (for a forward: the thread that called
``llama_decode``), with the GIL taken by ctypes; other Python threads keep running while it
waits. It must not call back into llama.cpp: the aborting call's state is broken.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from smcspec.backends.llamacpp.rpc import ggml_library

log = logging.getLogger(__name__)

ABORT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)  # ggml_abort_callback_t


@contextmanager
def on_abort(handler: Callable[[str], None]) -> Iterator[None]:
    """While inside, llama.cpp calls ``handler(message)`` before it aborts the process.

    ``message`` is ggml's ``"file:line: text"`` (the file without its directories). When
    ``handler`` returns (or raises: the exception is logged, never passed into C), ggml calls
    ``abort()`` (SIGABRT). ggml prints no message or backtrace of its own while a callback
    is installed, so the handler logs it. On leaving, the previous callback (or none) is
    restored. The callback is process-wide: nest these, do not run two side by side.

    Raises:
        ConfigError: llama-cpp-python is not installed.
    """
    lib = ggml_library()
    setter = lib.ggml_set_abort_callback  # in libggml-base, found through libggml's deps
    setter.argtypes, setter.restype = [ABORT_CALLBACK], ctypes.c_void_p

    def call(message: bytes | None) -> None:
        where, sep, what = (message or b"").decode("utf-8", "replace").partition(": ")
        text = f"{os.path.basename(where)}{sep}{what}"
        try:
            handler(text)
        except BaseException:  # an exception cannot cross into C
            log.exception("the llama.cpp abort handler failed (ggml: %s)", text)

    callback = ABORT_CALLBACK(call)  # referenced until restored below
    previous = setter(callback)
    try:
        yield
    finally:
        setter(ABORT_CALLBACK(previous) if previous else ABORT_CALLBACK())
