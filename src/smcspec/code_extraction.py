"""The code in a chat model's answer: the fenced block to run, and whether it is a whole
function or the body that continues a prompt's stub.

Shared by HumanEval's scoring (:mod:`smcspec.eval.humaneval`) and the execution reward
(:mod:`smcspec.rewards.code`); it imports nothing of smcspec, so both sit above it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["CodeCompletion", "entry_point_of", "extract_code"]


@dataclass(frozen=True)
class CodeCompletion:
    """Code taken from a model answer.

    Attributes:
        code: the code.
        full_program: True if ``code`` defines the entry-point function itself and should be
            run after the prompt (whose stub it overrides) instead of continuing the prompt.
    """

    code: str
    full_program: bool


_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PY_LANGS = {"python", "py", "python3"}


def entry_point_of(prompt: str) -> str | None:
    """The last top-level ``def``'s name in ``prompt`` (HumanEval's entry point), or None."""
    names = re.findall(r"^def\s+([A-Za-z_]\w*)\s*\(", prompt, flags=re.MULTILINE)
    return names[-1] if names else None


def extract_code(text: str, prompt: str, entry_point: str | None = None) -> CodeCompletion:
    """Take the code to run from a chat model's answer.

    The first fenced block tagged python/py/python3 is used; failing that, the first fenced
    block of any language (an unterminated fence runs to the end of the text); failing that,
    the whole text. If that code contains ``def <entry_point>(`` at the start of a line, it is
    a full program (``full_program=True``): it is run after the prompt, whose stub function
    (a docstring-only body) it redefines, so imports and helper functions from the prompt stay
    available. Otherwise it is a continuation of the prompt (the function body).

    Args:
        text: the model answer.
        prompt: the prompt (e.g. HumanEval's) whose function the answer completes.
        entry_point: function name; default the last top-level ``def`` in ``prompt``.

    Returns:
        The :class:`CodeCompletion`; never raises.
    """
    blocks = _FENCE_RE.findall(text)
    code = text
    if blocks:
        python_blocks = [body for lang, body in blocks if lang.lower() in _PY_LANGS]
        code = python_blocks[0] if python_blocks else blocks[0][1]
    name = entry_point or entry_point_of(prompt)
    full = bool(name) and re.search(rf"^def\s+{re.escape(name)}\s*\(", code, re.MULTILINE)
    return CodeCompletion(code=code, full_program=bool(full))
