"""An execution reward for code: the share of the prompt's own examples that an answer passes.

``R(x)`` = (examples the code extracted from answer ``x`` passes) / (examples). The examples
are the input/output pairs a user wrote: the doctest lines of a prompt (``>>> f(1)`` then
``2``), one-line examples such as ``f(1) == 2``, ``f(1) ➞ 2`` or ``f(1) returns 2`` (the
style of many HumanEval prompts), or a file of ``assert`` statements or doctest lines. They
are never a benchmark's hidden tests. Each distinct code text runs once, in the sandbox of
:mod:`smcspec.sandbox` (bubblewrap where it works), every example in turn inside the one
program; an example that raises, or that the time limit cut, fails. An answer with no code
passes nothing (R = 0).

The prefix twist (:meth:`CodeExamples.prefix_score`) is the standard library's answer to
"does the code so far still parse as the start of a Python program" (``codeop``: complete
or incomplete, not a syntax error), on the complete lines of the first code block: a prefix
that is already broken can only end with R = 0, so it scores 0; any other prefix scores
``viable`` (default 0.5, the prior mean of R). SMC-SD multiplies a particle's weight by
``exp(beta * (new - old))`` each round (Naesseth et al. 2019; Lew et al. 2023), so broken
code is dropped at the next resampling instead of at the end.

The vote over particles (:meth:`CodeExamples.behaviour`) groups answers by what their code
does on the examples (the repr of each result, or the exception's name).
"""

from __future__ import annotations

import ast
import codeop
import doctest
import math
import re
import secrets
import warnings
from dataclasses import dataclass, field

from smcspec.code_extraction import CodeCompletion, entry_point_of, extract_code
from smcspec.errors import ConfigError
from smcspec.potentials import Reward
from smcspec.sandbox import Limits, run_python

__all__ = [
    "CodeExamples",
    "Example",
    "code_of_prompt",
    "examples_from_prompt",
    "examples_from_tests",
]


@dataclass(frozen=True)
class Example:
    """One example: the Python expression ``call`` must evaluate to the value of ``want``
    (compared with ``==``; floats with a relative tolerance of 1e-6)."""

    call: str
    want: str


def _is_expression(src: str) -> bool:
    try:
        ast.parse(src.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return False
    return bool(src.strip())


_WORDS = {"true": "True", "false": "False", "null": "None", "none": "None"}
_SEPARATOR = re.compile(r"\s*(?:#\s*)?(?:==>|==|=>|➞|->|=|:|should\s+return|returns?)\s*", re.I)


def _longest_expression(text: str) -> str | None:
    """The longest prefix of ``text`` that is a Python expression (``true``/``false``/``null``
    read as Python's), without a trailing full stop."""
    text = re.sub(r"\b(true|false|null|none)\b", lambda m: _WORDS[m.group(1).lower()], text)
    for end in range(len(text), 0, -1):
        candidate = text[:end].strip().rstrip(".").strip()
        if candidate and _is_expression(candidate):
            return candidate
    return None


def _inline_examples(prompt: str, entry_point: str) -> list[Example]:
    out = []
    for line in prompt.splitlines():
        start = line.find(f"{entry_point}(")
        if start < 0 or line.lstrip().startswith("def "):
            continue
        rest = line[start:]
        ends = [i + 1 for i, c in enumerate(rest) if c == ")"]
        call = next((rest[:e] for e in ends if _is_expression(rest[:e])), None)
        if call is None:
            continue
        sep = _SEPARATOR.match(rest[len(call) :])
        want = _longest_expression(rest[len(call) + sep.end() :]) if sep else None
        if want is not None:
            out.append(Example(call, want))
    return out


def _doctest_examples(text: str) -> list[Example]:
    """The doctest examples of ``text`` as written (escapes such as ``\\n`` kept); where
    doctest cannot parse the whole text (inconsistent indentation, e.g. a closing code fence
    after a docstring), those of each docstring when ``text`` parses as Python; else none."""
    try:
        found = doctest.DocTestParser().get_examples(text)
    except ValueError:  # doctest's "inconsistent leading whitespace"
        found = []
        for chunk in _docstrings(text):
            try:
                found += doctest.DocTestParser().get_examples(chunk)
            except ValueError:
                continue
    out = []
    for ex in found:
        want = "\n".join(
            ln for ln in ex.want.splitlines() if ln.strip() not in ('"""', "'''", "")
        ).strip()
        if _is_expression(ex.source) and want and _is_expression(want):
            out.append(Example(ex.source.strip(), want))
    return out


def _docstrings(code: str) -> list[str]:
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return []
    nodes = [n for n in ast.walk(tree) if isinstance(n, _DOCUMENTED)]
    return [d for d in (ast.get_docstring(n) for n in nodes) if d]


_DOCUMENTED = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def code_of_prompt(prompt: str) -> str:
    """The code a prompt gives the answer to build on: its first fenced block, else the
    prompt itself if it has a top-level ``def``, else nothing."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", prompt, flags=re.DOTALL | re.MULTILINE)
    if blocks:
        return blocks[0]
    return prompt if entry_point_of(prompt) else ""


def examples_from_prompt(prompt: str, entry_point: str | None = None) -> list[Example]:
    """The examples written in ``prompt``: its doctest lines, else its one-line examples of
    ``entry_point`` (default: the last top-level ``def`` in the prompt) such as
    ``f(1) == 2``, ``f(1) ==> 2``, ``f(1) ➞ 2``, ``f(1) returns 2``. Lines whose call or
    value is not a Python expression are skipped. May be empty."""
    found = _doctest_examples(prompt)
    name = entry_point or entry_point_of(prompt)
    if not found and name:
        found = _inline_examples(prompt, name)
    return found


def examples_from_tests(text: str) -> list[Example]:
    """Examples from a tests file: doctest lines if it has any, else its ``assert``
    statements (``assert f(1) == 2`` becomes call ``f(1)``, want ``2``; any other assertion
    must be true).

    Raises:
        ConfigError: the file is neither doctest lines nor Python, or has no example.
    """
    found = _doctest_examples(text) if ">>>" in text else []
    if not found:
        try:
            tree = ast.parse(text)
        except SyntaxError as e:
            raise ConfigError(f"tests are neither doctest lines nor Python: {e}") from e
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assert):
                continue
            test = node.test
            eq = isinstance(test, ast.Compare) and len(test.ops) == 1
            if eq and isinstance(test.ops[0], ast.Eq):
                found.append(Example(ast.unparse(test.left), ast.unparse(test.comparators[0])))
            else:
                found.append(Example(ast.unparse(test), "True"))
    if not found:
        raise ConfigError("no examples in the tests (doctest lines or assert statements)")
    return found


@dataclass(frozen=True)
class Outcome:
    """What one code text did on the examples: how many passed, and the behaviour (one
    string per example: the result's repr, the exception's name, or ``"not run"``)."""

    passed: int
    behaviour: tuple[str, ...]
    has_code: bool


_HARNESS = """
import math as _smc_math, os as _smc_os
def _smc_same(got, want):
    if isinstance(got, float) or isinstance(want, float):
        try:
            return _smc_math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
        except TypeError:
            return False
    return bool(got == want)
for _smc_i, (_smc_call, _smc_want) in enumerate({pairs!r}):
    try:
        _smc_got = eval(_smc_call)
        _smc_ok = _smc_same(_smc_got, eval(_smc_want))
        _smc_rep = repr(_smc_got)[:200]
    except BaseException as _smc_e:
        _smc_ok, _smc_rep = False, type(_smc_e).__name__
    _smc_line = "\\n{nonce} %d %d %s\\n" % (_smc_i, _smc_ok, _smc_rep.replace("\\n", " "))
    _smc_os.write(1, _smc_line.encode("utf-8", "replace"))
"""


@dataclass
class CodeExamples:
    """The examples of one request, and the code runs that score answers against them.

    Attributes:
        examples: what the code must pass (:func:`examples_from_prompt`,
            :func:`examples_from_tests`); at least one.
        prompt_code: code the answer continues or completes (the function stub with its
            imports); an answer that defines the entry point runs after it, one that does not
            continues it.
        entry_point: the function's name (default: the last ``def`` in ``prompt_code``).
        limits: each run's limits (default 5 s, 1024 MiB, 4 MiB files).
        sandbox: ``"auto"``, ``"bwrap"`` or ``"rlimit"`` (:mod:`smcspec.sandbox`).
        viable: the prefix score of code that still parses (see the module docstring).
    Raises :class:`ConfigError` without examples or with ``viable`` outside [0, 1].
    Each distinct code text is run once; the outcomes are kept for the life of the object
    (one request).
    """

    examples: list[Example]
    prompt_code: str = ""
    entry_point: str | None = None
    limits: Limits = field(default_factory=lambda: Limits(timeout_s=5.0, file_size_mb=4))
    sandbox: str = "auto"
    viable: float = 0.5
    _outcomes: dict[str, Outcome] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.examples:
            raise ConfigError("the execution reward needs at least one example")
        if not 0 <= self.viable <= 1:
            raise ConfigError(f"viable must be in [0, 1], got {self.viable}")
        self.entry_point = self.entry_point or entry_point_of(self.prompt_code)

    @classmethod
    def from_prompt(cls, prompt: str, **kwargs) -> CodeExamples:
        """Examples and code from a prompt: its first fenced code block (or, without one, the
        prompt itself) is ``prompt_code``. Raises :class:`ConfigError` if it has no
        example."""
        code = code_of_prompt(prompt)
        examples = examples_from_prompt(code) or examples_from_prompt(prompt)
        if not examples:
            raise ConfigError(
                "no examples in the prompt (doctest lines such as '>>> f(1)' then '2', or "
                "'f(1) == 2'); pass a tests file instead"
            )
        return cls(examples, prompt_code=code, **kwargs)

    def program(
        self, text: str, nonce: str, code: CodeCompletion | None = None
    ) -> tuple[str, bool]:
        """The program that runs ``text``'s code against the examples, and whether ``text``
        has code (a fenced block, or text that compiles). ``code``: ``text``'s extracted
        code, if the caller has it already."""
        code = code or extract_code(text, self.prompt_code, self.entry_point)
        has_code = "```" in text or _compiles(code.code)
        sep = "\n" if code.full_program else ""
        pairs = [(e.call, e.want) for e in self.examples]
        body = f"{self.prompt_code}{sep}{code.code}\n" if has_code else ""
        return body + _HARNESS.format(pairs=pairs, nonce=nonce), has_code

    def outcome(self, text: str) -> Outcome:
        """Run ``text``'s code on the examples (once per distinct code text)."""
        code = extract_code(text, self.prompt_code, self.entry_point)
        key = code.code
        if key not in self._outcomes:
            nonce = f"SMCSPEC-EXAMPLE-{secrets.token_hex(8)}"
            program, has_code = self.program(text, nonce, code)
            results = ["not run"] * len(self.examples)
            passed = 0
            if has_code:
                run = run_python(program, self.limits, self.sandbox)
                for line in run.stdout.decode("utf-8", "replace").splitlines():
                    parts = line.split(" ", 3)
                    if len(parts) == 4 and parts[0] == nonce and parts[1].isdigit():
                        i = int(parts[1])
                        if i < len(results) and results[i] == "not run":
                            results[i] = parts[3]
                            passed += parts[2] == "1"
            self._outcomes[key] = Outcome(passed, tuple(results), has_code)
        return self._outcomes[key]

    def score(self, texts: list[str]) -> list[float]:
        """``R`` of each complete answer: the share of examples passed, in [0, 1]."""
        return [self.outcome(t).passed / len(self.examples) for t in texts]

    def prefix_score(self, texts: list[str]) -> list[float]:
        """The twist of each prefix: 0 if the code so far can no longer parse, else
        ``viable``."""
        return [0.0 if _broken(t, self.prompt_code) else self.viable for t in texts]

    def behaviour(self, text: str) -> str | None:
        """The answer's behaviour class for a vote: its results on the examples, one per
        line; None when the answer has no code."""
        out = self.outcome(text)
        return "\n".join(out.behaviour) if out.has_code else None

    def reward(self, beta: float = 5.0, twist: bool = True) -> Reward:
        """The reward ``exp(beta * R(x))`` for SMC-SD, with the parse twist unless
        ``twist`` is False (then the whole reward applies at the end)."""
        if not (math.isfinite(beta) and beta >= 0):
            raise ConfigError(f"reward beta must be a finite number >= 0, got {beta}")
        return Reward(self.score, beta, self.prefix_score if twist else None)


def _compiles(code: str) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile(code, "<answer>", "exec")
    except (SyntaxError, ValueError, OverflowError):
        return False
    return bool(code.strip())


def _broken(text: str, prompt_code: str) -> bool:
    """Whether the first code block of the answer prefix ``text`` (as :func:`extract_code`
    chooses it) is already a syntax error, judged on its complete lines (the last line may be
    cut mid-token). No code block yet: not broken."""
    if "```" not in text:
        return False
    code = extract_code(text, prompt_code).code
    closed = text.count("```") >= 2
    if not closed:
        code = code[: code.rfind("\n") + 1]
    if not code.strip():
        return False
    first = next(ln for ln in code.splitlines() if ln.strip())
    if first[:1].isspace():  # a continuation of the prompt's function
        code = prompt_code + code
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            codeop.compile_command(code, "<prefix>", "exec")
    except (SyntaxError, ValueError, OverflowError):
        return True
    return False
