"""Files a user names on the command line, read with bounds: a regular file, within a size,
valid UTF-8 text without NUL bytes, and JSON parsed with a nesting limit.

Every input file of ``generate``, ``serve``, ``bench``, ``eval`` and ``distill`` (calibration
prompts, JSON schemas, grammars, tests, distillation prompts) goes through
:func:`read_text_file` before any model loads, so that ``/dev/zero``, a FIFO, a directory or
a file of gigabytes is refused with one ``error:`` line in bounded time and memory instead of
being read until memory runs out or blocking forever.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import numpy as np

from smcspec.errors import ConfigError

MAX_INPUT_BYTES = 64 << 20  # 64 MiB: the default bound of a named input file
MAX_JSON_DEPTH = 64  # arrays and objects nested deeper are refused before parsing


def read_text_file(path: str | os.PathLike, what: str, max_bytes: int = MAX_INPUT_BYTES) -> str:
    """The text of the regular file ``path``, read only if it is one and within ``max_bytes``.

    The file is opened without blocking (a FIFO would wait for a writer) and checked on the
    open descriptor, so a path swapped after the check cannot bypass it; at most
    ``max_bytes + 1`` bytes are ever read.

    Args:
        path: the file.
        what: how the error names it (``"the calibration prompts"``).
        max_bytes: the largest size accepted.
    Raises:
        ConfigError: a missing path, not a regular file (directory, FIFO, device, socket),
            larger than ``max_bytes``, unreadable, not UTF-8, or holding NUL bytes (binary).
    """
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError(f"{what} {p}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {p}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{what} {p} is not a regular file ({_kind(info.st_mode)})")
        if info.st_size > max_bytes:
            raise ConfigError(
                f"{what} {p} holds {info.st_size:,} bytes; at most {max_bytes:,} are read"
            )
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {p}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ConfigError(f"{what} {p} grew past {max_bytes:,} bytes while being read")
    if b"\0" in data:
        raise ConfigError(f"{what} {p} is binary (it holds NUL bytes); expected text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{what} {p} is not UTF-8 text: {exc.reason} at byte {exc.start}"
        ) from None


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a plain file"


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``text`` (brackets inside
    strings skipped), found in linear time without parsing."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if not brackets:
        return 0
    steps = np.frombuffer(brackets.encode("ascii"), dtype=np.uint8)
    opens = (steps == ord("[")) | (steps == ord("{"))
    return int(np.cumsum(np.where(opens, 1, -1)).max(initial=0))


def loads_bounded(text: str, what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(text)`` after refusing nesting deeper than ``max_depth``.

    Raises:
        ConfigError: too deep, or not JSON (naming ``what`` and the parser's message).
    """
    if (depth := json_depth(text)) > max_depth:
        raise ConfigError(f"{what} nests JSON {depth} levels deep; at most {max_depth}")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ConfigError(f"{what} is not valid JSON: {exc}") from None
