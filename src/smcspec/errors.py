"""Exceptions raised by smcspec.

Every error a user can cause (bad option, bad model file, prompt too long, numerical failure)
is a subclass of :class:`SmcspecError`; the CLI prints its message and exits with
:attr:`SmcspecError.exit_code` instead of a traceback.
"""

from __future__ import annotations


class SmcspecError(Exception):
    """Base class of all user-facing smcspec errors."""

    exit_code = 1


class ConfigError(SmcspecError, ValueError):
    """An option is out of range or inconsistent (N < 1, K < 1, temperature <= 0, ...)."""

    exit_code = 2


class PromptError(ConfigError):
    """A prompt that cannot be decoded: empty, or a token id outside the vocabulary."""


class RpcServerError(ConfigError):
    """An RPC server (``--rpc HOST:PORT``) cannot be used: the connection is refused, the
    peer does not answer llama.cpp's RPC handshake in time, answers another protocol, or
    speaks another protocol version; or ``smcspec rpc-server`` cannot listen (its port in
    use, an address not this machine's). Exits with 1: the command was right, the peer or
    the machine was not."""

    exit_code = 1


class ModelFileError(SmcspecError):
    """A model file or package is missing, truncated, altered or of an unsupported kind."""

    exit_code = 3


class ContextLengthError(SmcspecError, ValueError):
    """The prompt plus the requested new tokens do not fit the model's context."""

    exit_code = 2


class NumericalError(SmcspecError, ArithmeticError):
    """A model produced NaN logits, or a distribution could not be normalised."""

    exit_code = 4


class BackendFailure(SmcspecError):
    """A model's backend failed fatally and the process cannot go on: llama.cpp aborted
    (``GGML_ABORT``: an RPC server lost mid-forward, a GPU error). The server fails its
    requests with this (HTTP 5xx) before the process exits."""
