"""The decoder table: which decoder runs a request is decided in one place, and no code outside
``decoding/registry.py`` switches on a method's, a draft's or a decoder's name."""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from enumerable import tiny_transformer

import smcspec
from smcspec import GenerationConfig
from smcspec.config import DRAFT_KINDS, METHOD_PARTICLES, METHODS
from smcspec.decoding.job import job_for
from smcspec.decoding.labels import BASELINE_LABEL, Label, parse_label, setting_label
from smcspec.decoding.program import run_program
from smcspec.decoding.registry import (
    BASELINE,
    BY_METHOD,
    CHOICES,
    DECODERS,
    decoder_for,
    decoder_named,
    without_default_ngram,
)
from smcspec.errors import ConfigError
from smcspec.potentials import Regex

SRC = Path(smcspec.__file__).parent
REGISTRY = "decoding/registry.py"

NAMES = (
    set(CHOICES)
    | set(METHODS)
    | {d.method for d in DECODERS.values()}
    | set(DECODERS)
    | set(DRAFT_KINDS)
)
"""Every name the table gives: the methods and ``auto``, the decoders, the drafts."""

KEYS = NAMES - set(DRAFT_KINDS)
"""The names a table is keyed by (the methods, ``auto``, the decoders): a dict keyed by one,
a field or a keyword called one. A draft's name is an ordinary word there (a ``model``
field, an ``ngram`` flag)."""

TABLES = {"DECODERS", "BY_METHOD", "CHOICES"}
"""The registry's dicts keyed by a name: code outside asks its functions instead."""

SETS = {"method", "draft"}
"""The config fields that name a method or a draft: a call that sets one to a name under a
condition (``replace(cfg, method="ar")`` in an ``if``) decides a method."""

LABEL_WORDS = ("keep", "reward", "ess", "eps", "vote", "greedy", "sc", "bon")
"""The words of setting labels past a decoder's own part (``smc-n8-k2-keep``, ``ar-bon-n4``)."""

STRING_MATCHES = {"startswith", "endswith", "removeprefix", "removesuffix", "split", "partition"}
"""The string methods that match or cut a string by a piece of it."""

LABEL_PIECE = re.compile(
    r"(?:^|[^\w-])(?:" + "|".join(sorted(METHODS)) + r")(?:-|$)"
    r"|-(?:" + "|".join(LABEL_WORDS) + r")(?![a-z])"
)
"""A piece of a setting label: a method's name at its start (``ar-``, ``smc``) or one of
:data:`LABEL_WORDS` after a dash (``-reward``, ``-ess``)."""

LABELS = "decoding/labels.py"
"""The setting-label grammar: the one module besides the registry that may match, split or
format label pieces (every other rule applies to it)."""

NOT_METHODS = {
    ("backends/torch/transformer.py", "self.rounds == 'auto'"),  # how rounds run
    ("backends/torch/transformer.py", "mode == 'auto'"),  # which kernel set the layers run
    ("backends/torch/transformer.py", "self.kernel_mode != 'auto'"),
    ("models/loading.py", "backend == 'auto'"),  # which backend loads a file
    ("models/pair.py", "backend == 'auto'"),
    ("sandbox.py", "sandbox == 'auto'"),  # which sandbox runs code
    ("tool_calls/spec.py", "self.choice == 'auto'"),  # OpenAI's tool_choice
    ("tool_calls/spec.py", "self.choice in ('auto', 'required')"),
    # config.py, below the table, keeps as data what a config resolves when it is made (the
    # drafts' rows, the default method and draft, each method's default N; checked against
    # the table by test_the_defaults_kept_beside_the_table_agree_with_it)
    ("config.py", "Draft('model', from_text=False, p_min=0.0)"),
    ("config.py", "Draft('ngram', from_text=True, p_min=NGRAM_DRAFT_P_MIN)"),
    ("config.py", "server_setting('smc', METHODS)"),
    ("config.py", "server_setting('model', DRAFTS)"),
    ("config.py", "{'smc': DEFAULT_PARTICLES, 'sd': 1, 'ar': 1}"),
    ("server/schemas.py", "smc: SmcOptions | None = None"),  # the API's extension object
}
"""Spellings of a name that are not a method decision: other settings' own ``"auto"``, the
data ``config.py`` keeps, the OpenAI body's ``smc`` field; each by file and expression (the
same spelling elsewhere is flagged)."""


def _defined(path: Path, kind: type, suffix: str = "") -> set[str]:
    """Names of the module-level definitions of ``kind`` in ``path`` ending in ``suffix``."""
    body = ast.parse(path.read_text()).body
    return {n.name for n in body if isinstance(n, kind) and n.name.endswith(suffix)}


@functools.cache
def _lookups(root: Path) -> set[str]:
    """The registry's functions (``decoder_named``, ``choice``, ...): each takes a name."""
    return _defined(root / REGISTRY, ast.FunctionDef)


@functools.cache
def _traits(root: Path) -> set[str]:
    """The string traits of the registry's rows: fields annotated ``str`` of its classes,
    but a row's ``name`` and ``method`` (compared elsewhere, a string trait's values stand
    for the rows that hold them: ``Choice.tuned == "always"`` is ``auto``)."""
    out = set()
    for node in ast.parse((root / REGISTRY).read_text()).body:
        if isinstance(node, ast.ClassDef):
            for f in node.body:
                if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name):
                    if ast.unparse(f.annotation) in ("str", "str | None"):
                        out.add(f.target.id)
    return out - {"name", "method"}


@functools.cache
def _rows(root: Path) -> set[str]:
    """The registry's module-level constants (``BASELINE``, ...): its rows by another name."""
    out = set()
    for node in ast.parse((root / REGISTRY).read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        out |= {t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper()}
    return out - TABLES


def _stats_classes() -> set[str]:
    """The decoders' stats classes (``ArStats``, ``SdStats``, ``SmcStats``): the ones the
    table's rows name (:attr:`~smcspec.decoding.registry.Decoder.stats_class`)."""
    return {d.stats_class.__name__ for d in DECODERS.values()}


def _stats_fields() -> set[str]:
    """Every field of a decoder's stats class (``log_normalizer``, ``accepted``, ...)."""
    return {f.name for d in DECODERS.values() for f in fields(d.stats_class)}


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level names bound to a string (``NGRAM = "ngram"``)."""
    out = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            if isinstance(value.value, str):
                out[target.id] = value.value
    return out


@functools.cache
def _file_constants(path: Path) -> dict[str, str]:
    return _constants(ast.parse(path.read_text()))


def _module_file(root: Path, module: str) -> Path | None:
    parts = module.split(".")[1:]  # smcspec.cli.engine_args -> cli/engine_args
    for path in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
        if parts and path.is_file():
            return path
    return None


def _strings(tree: ast.Module, root: Path) -> dict[str, str]:
    """The names a module can use for a string: its own constants and those it imports from
    another module of the package (``from smcspec.cli.engine_args import NGRAM``)."""
    out = _constants(tree)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("smcspec."):
            path = _module_file(root, node.module)
            if path is not None:
                theirs = _file_constants(path)
                for a in node.names:
                    if a.name in theirs:
                        out[a.asname or a.name] = theirs[a.name]
    return out


def _conditional(tree: ast.AST) -> set[int]:
    """The ids of the nodes inside a branch (an ``if``'s or a conditional expression's
    body or else, a ``match`` case), not counting the tests."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If | ast.IfExp):
            parts = node.body if isinstance(node.body, list) else [node.body]
            parts = [*parts, *(node.orelse if isinstance(node.orelse, list) else [node.orelse])]
        elif isinstance(node, ast.match_case):
            parts = node.body
        else:
            continue
        out |= {id(n) for part in parts for n in ast.walk(part)}
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstrings' (and other bare strings') constants."""
    return {
        id(n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
    }


class _Scan:
    """The method switches of one module (:func:`method_switches`)."""

    def __init__(
        self, strings: dict[str, str], lookups: set[str], traits: set[str], rows: set[str],
        labels: bool = True,
    ):  # fmt: skip
        self.strings, self.lookups, self.traits, self.rows = strings, lookups, traits, rows
        self.stats, self.stats_fields = _stats_classes(), _stats_fields()
        self.labels = labels  # the label rule applies (not in the grammar's own module)
        self.conditional: set[int] = set()

    def names(self, node: ast.AST) -> set[str]:
        """The table's names ``node`` spells: a string, a constant bound to one, or a tuple,
        list or set of them."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value} & NAMES
        if isinstance(node, ast.Name) and node.id in self.strings:
            return {self.strings[node.id]} & NAMES
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return set().union(*(self.names(e) for e in node.elts)) if node.elts else set()
        return set()

    def one_name(self, node: ast.AST) -> bool:
        """``node`` is a string naming one of the table's names, or a constant bound to one
        (not a tuple of them: a key made of several parts)."""
        return not isinstance(node, ast.Tuple | ast.List | ast.Set) and bool(self.names(node))

    def text(self, node: ast.AST) -> str | None:
        """The string ``node`` spells, or None."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return self.strings.get(node.id)
        return None

    def label_piece(self, node: ast.AST) -> bool:
        """``node`` spells a string holding a piece of a setting label (:data:`LABEL_PIECE`)."""
        text = self.text(node)
        return self.labels and text is not None and LABEL_PIECE.search(text) is not None

    @staticmethod
    def named(node: ast.AST, names: set[str]) -> bool:
        """``node`` is a variable or an attribute called one of ``names``."""
        return (isinstance(node, ast.Name) and node.id in names) or (
            isinstance(node, ast.Attribute) and node.attr in names
        )

    def hits(self, node: ast.AST) -> list[tuple[int, str, str]]:
        """``(line, kind, expression)`` of each switch ``node`` is: one for an expression,
        one per field or parameter for a class or a signature."""
        if isinstance(node, ast.ClassDef):
            return [(f.lineno, k, ast.unparse(f)) for f in node.body if (k := self.why_field(f))]
        if isinstance(node, ast.arguments):
            params = [*node.posonlyargs, *node.args]
            pairs = [*zip(params[len(params) - len(node.defaults):], node.defaults, strict=True),
                     *zip(node.kwonlyargs, node.kw_defaults, strict=True)]  # fmt: skip
            return [
                (a.lineno, "defaults to a name", f"{a.arg}={ast.unparse(d)}")
                for a, d in pairs
                if d is not None and self.default_names(a.arg, d)
            ]
        kind = self.why(node)
        return [] if kind is None else [(node.lineno, kind, ast.unparse(node))]

    def why(self, node: ast.AST) -> str | None:
        """What kind of switch the expression ``node`` is, or None."""
        if isinstance(node, ast.Compare):
            return self.why_compare(node)
        if isinstance(node, ast.Subscript):
            if self.named(node.value, TABLES):
                return "looks a name up in the table's dicts"
            if isinstance(node.slice, ast.Constant | ast.Name) and self.names(node.slice):
                return "looks a name up"
        elif isinstance(node, ast.Call):
            return self.why_call(node)
        elif isinstance(node, ast.MatchValue) and self.names(node.value):
            return "matches a name"
        elif isinstance(node, ast.Dict):
            if any(k is not None and self.names(k) & KEYS for k in node.keys):
                return "keys a dict by a name"
        elif isinstance(node, ast.JoinedStr) and self.labels:
            parts = [v for v in node.values if isinstance(v, ast.Constant)]
            if any(re.fullmatch(r"(-[a-z]+)+", v.value) and self.label_piece(v) for v in parts):
                return "formats a setting label"
        return None

    def why_compare(self, node: ast.Compare) -> str | None:
        sides = (node.left, *node.comparators)
        if any(self.names(s) for s in sides):
            return "compares a name"
        if any(self.named(s, {"method"}) for s in sides):
            return "compares a method"
        if any(self.named(c, TABLES) for c in node.comparators):
            return "looks a name up in the table's dicts"
        if any(self.named(s, self.stats) for s in sides):
            return "compares a stats class"
        if any(self.named(s, self.rows) for s in sides):
            return "compares a row of the table"
        if any(self.named(s, self.traits) for s in sides) and any(self.text(s) for s in sides):
            return "compares a trait's value"
        ins = any(isinstance(op, ast.In | ast.NotIn) for op in node.ops)
        if ins and self.label_piece(node.left):
            return "parses a setting label"
        return None

    def why_call(self, node: ast.Call) -> str | None:
        func, args = node.func, [*node.args, *(k.value for k in node.keywords)]
        if isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault"):
            if self.named(func.value, TABLES):
                return "looks a name up in the table's dicts"
            if node.args and isinstance(node.args[0], ast.Constant | ast.Name):
                if self.names(node.args[0]):
                    return "looks a name up"
        if self.named(func, self.lookups) and any(self.names(a) for a in args):
            return "asks the table for a name"
        if self.named(func, {"isinstance", "issubclass"}) and len(node.args) == 2:
            kinds = node.args[1]
            kinds = kinds.elts if isinstance(kinds, ast.Tuple) else [kinds]
            if any(self.named(k, self.stats) for k in kinds):
                return "switches on a stats class"
        if self.named(func, {"getattr", "hasattr"}) and len(node.args) >= 2:
            on, field = node.args[0], self.text(node.args[1])
            if field in self.stats_fields and ast.unparse(on).endswith("stats"):
                return "reads a stats field by name"
        if any(self.one_name(a) for a in node.args):
            return "passes a name"
        if any(k.arg in KEYS for k in node.keywords):
            return "keys by a name"
        sets = [k for k in node.keywords if k.arg in SETS and self.one_name(k.value)]
        if sets and id(node) in self.conditional:
            return "sets a method by name under a condition"
        if isinstance(func, ast.Attribute) and any(self.label_piece(a) for a in node.args):
            if func.attr in STRING_MATCHES or self.named(func.value, {"re"}):
                return "parses a setting label"
        return None

    def default_names(self, field: str, value: ast.AST) -> bool:
        """A default naming a method, a decoder or a draft (``auto`` only where the field is
        a method: other settings have an ``"auto"`` of their own)."""
        names = self.names(value) if self.one_name(value) else set()
        return bool(names - {"auto"}) or (bool(names) and field == "method")

    def why_field(self, node: ast.stmt) -> str | None:
        """What a class body's field ``node`` is: named after a name, or defaulting to one."""
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.target.id in KEYS:
                return "names a field after a name"
            if node.value is not None and self.default_names(node.target.id, node.value):
                return "defaults to a name"
        return None


def method_switches(
    source: str | ast.Module,
    strings: dict[str, str],
    root: Path = SRC,
    traits: set[str] | None = None,
    labels: bool = True,
) -> list[tuple]:
    """``(line, kind, expression)`` of every method switch in ``source``:

    - a comparison (``==``, ``!=``, ``in``, ``not in``, ``is``) with a string, or a constant
      bound to one, that names a method (``ar``, ``sd``, ``smc``, ``auto``), a draft
      (``model``, ``ngram``) or a decoder (``multi-sd``, ``ngram-sd``), whatever the other
      side is called; a subscript or ``.get`` with such a key; a ``match`` case on one;
    - a registry function given one (``decoder_named("ar")``), or any call given one as an
      argument (``choose(predictions, "auto")``), or a keyword named after one
      (``Tuning(auto=...)``); a call that sets ``method`` or ``draft`` to one inside a
      branch (``if masked: return replace(cfg, method="ar")``: a decision, where the same
      construction unconditioned is a fixed setting);
    - a dict keyed by one, a class field named after one (``auto: Prediction``), a
      parameter or field defaulting to one (``baseline: str = "ar"``; ``"auto"`` only for a
      ``method``);
    - a comparison of a ``method`` variable or ``.method`` attribute with anything; of a
      string trait of the table's rows (``traits``: default, the fields ``root``'s
      registry annotates ``str``; ``c.tuned == "always"``) with a string; of one of the
      registry's constants (``d is BASELINE``); any lookup in the table's dicts
      (``BY_METHOD[x]``, ``x in BY_METHOD``);
    - a type switch on a decoder's stats class (``isinstance(s, SmcStats)``), or a stats
      field read by name (``getattr(out.stats, "log_normalizer", None)``);
    - unless ``labels`` is False (the label grammar's own module): a setting label parsed
      or formatted by its pieces (:data:`LABEL_PIECE`): ``startswith``, ``split`` and the
      like or a regular expression given one, an ``in`` test of one, an f-string appending
      one (``f"{label}-ess"``).

    ``source``: its text or tree; ``strings``: the module's constants (:func:`_strings`)."""
    tree = ast.parse(source) if isinstance(source, str) else source
    traits = _traits(root) if traits is None else traits
    scan = _Scan(strings, _lookups(root), traits, _rows(root), labels)
    scan.conditional = _conditional(tree)
    docstrings = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        if id(node) not in docstrings:
            out += scan.hits(node)
    return sorted(set(out))


def switches_under(root: Path) -> dict[str, list[tuple]]:
    """:func:`method_switches` of every module under ``root`` (a copy of ``src/smcspec``),
    outside ``decoding/registry.py`` and the :data:`NOT_METHODS` spellings (the label rule
    not in :data:`LABELS`)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        if rel == REGISTRY:
            continue
        tree = ast.parse(path.read_text())
        strings = _strings(tree, root)
        hits = [
            h
            for h in method_switches(tree, strings, root, labels=rel != LABELS)
            if (rel, h[2]) not in NOT_METHODS
        ]
        if hits:
            found[rel] = hits
    return found


def test_methods_are_named_in_the_registry_only():
    """Everything that differs between methods and drafts is the decoder table's
    (``decoding/registry.py``): elsewhere code asks the table (a decoder's traits, its round,
    its name), never compares or looks up a name. Fails on cb48c1a with each of the 18
    switches of issue 75 (:data:`CB48C1A_SWITCHES`), on dc25221 with each of the 26
    spellings of issue 86 (:data:`DC25221_SWITCHES`), and on any new one."""
    found = switches_under(SRC)
    assert found == {}, found


def test_every_exemption_is_still_there():
    """An exemption that no longer matches code is removed (they cannot pile up)."""
    seen = set()
    for rel, _ in NOT_METHODS:
        tree = ast.parse((SRC / rel).read_text())
        hits = method_switches(tree, _strings(tree, SRC))
        seen |= {(rel, h[2]) for h in hits}
    assert seen == NOT_METHODS


CB48C1A_SWITCHES = [
    ("server/completions.py:103",
     'if cfg.constraint is not None or updates.get("method") == "smc":'),
    ("server/completions.py:99", 'if cfg.draft != "ngram" or "draft" in updates:'),
    ("cli/bench.py:115",
     'return "auto" in methods or ("smc" in methods and unset and args.grid is None)'),
    ("cli/bench.py:132", 'if name == "auto":'),
    ("cli/bench.py:136",
     'elif name == "smc" and tunes and args.grid is None and tuning is not None:'),
    ("eval/throughput.py:175", 'if decoder_for(s.config).name != "smc":'),
    ("config.py:273", 'return NGRAM_DRAFT_P_MIN if self.draft == "ngram" else 0.0'),
    ("config.py:340", 'if self.draft == "ngram" and self.constraint is not None:'),
    ("cli/options.py:253", 'ngram = args.draft == "ngram"'),
    ("eval/roofline.py:49", 'ar_t, _ = DECODERS["ar"].shapes(1, 0)'),
    ("eval/roofline.py:50", 'smc_t, smc_d = DECODERS["smc"].shapes(n, k)'),
    ("eval/roofline.py:68", 'smc_tokens, smc_seconds = DECODERS["smc"].cost(n, k, priced)'),
    ("eval/roofline.py:69", 'ar_tokens, ar_seconds = DECODERS["ar"].cost(1, 0, priced)'),
    ("eval/harness.py:118", 'ar = replace(base, method=BY_METHOD["ar"].method)'),
    ("cli/options.py:251", "if BY_METHOD[choice(args.method).method].particles:"),
    ("eval/fidelity.py:157", "return BY_METHOD[self.method].particles"),
    ("cli/generate.py:84",
     'elif isinstance(result.decode_stats, SmcStats) and args.aggregate == "vote":'),
    # not in the count, found by this scan on cb48c1a
    ("cli/bench.py:33",
     'engine = load_engine(args, with_draft=needs_draft or "auto" in '
     "_bench_methods(args))"),
    ("eval/harness.py:110", "if name in BY_METHOD:"),
    ("eval/harness.py:111", "d = BY_METHOD[name]"),
    ("cli/engine_args.py:33", "None if args.draft == NGRAM else args.draft,"),
    ("cli/serve.py:37", "engine = load_engine(args, with_draft=args.draft != NGRAM)"),
]  # fmt: skip
"""cb48c1a's method switches outside the table, one line each as it stood (comments cut): the
18 of issue 75 (``cli/bench.py:115`` holds two) and five more (``NGRAM`` is
``cli/engine_args.py``'s constant ``"ngram"``)."""


@pytest.mark.parametrize("site, line", CB48C1A_SWITCHES, ids=[s for s, _ in CB48C1A_SWITCHES])
def test_the_scan_sees_each_old_switch(site, line):
    """Each switch cb48c1a had outside the table is flagged, once per comparison or lookup:
    the guard above fails on that code (``git archive cb48c1a src/smcspec`` scanned with
    :func:`switches_under` gives these sites, and nothing else)."""
    code = re.sub(r"^elif ", "if ", line)
    code = "def _():\n    " + (code + " pass" if code.endswith(":") else code)
    hits = method_switches(code, {"NGRAM": "ngram"})
    assert len(hits) == (2 if site == "cli/bench.py:115" else 1), hits


def test_the_scan_sees_each_spelling():
    """Each kind of switch is found, whatever the variable is called; a name in a string
    that is not a comparison or lookup (a label, a message, a construction) is not."""
    flagged = [
        "a = cfg.method == 'ar'",
        "b = setting.kind != 'sd'",
        "c = 'smc' in names",
        "d = x not in ('auto', 'ar')",
        "e = table['multi-sd']",
        "f = table.get('ngram-sd')",
        "g = decoder_named('sd')",
        "h = choice(name='auto')",
        "i = isinstance(stats, (SdStats, SmcStats))",
        "j = BY_METHOD[x]",
        "k = x in CHOICES",
        "l = DECODERS.get(x)",
        "m = DRAFT == x",
        "n = w.source == 'model'",
        "o = job.config.method != other.method",
        "match x:\n    case 'ngram':\n        pass",
        # the spellings of issue 86 (dc25221): a trait's values, picks keyed by name, a
        # name passed on, a method set in a branch, label pieces, defaults, a stats field
        "a2 = c.tuned == 'always'",
        "b2 = tuned != 'never'",
        "c2 = choose(predictions, 'auto')",
        "d2 = Tuning(auto=best)",
        "e2 = {'smc': x, 'ar': y}",
        "class Picks:\n    smc: Prediction",
        "if masked:\n    cfg = replace(cfg, method='ar')",
        "cfg = replace(cfg, draft='model') if masked else cfg",
        "def f(records, baseline='ar'):\n    pass",
        "def f(preds, method='auto'):\n    pass",
        "class S:\n    draft: str = 'model'",
        "g2 = name.startswith('ar-bon-n')",
        "h2 = '-reward' in name",
        r"i2 = re.compile(r'ar-(?:greedy|sc-n(\d+))')",
        "j2 = re.fullmatch(r'(?P<keep>-keep)?(?P<ess>-ess)?', rest)",
        "k2 = f'{label}-ess'",
        "l2 = getattr(out.stats, 'log_normalizer', None)",
        "m2 = decoder is BASELINE",
    ]
    plain = [
        "p = f'smc-n{n}'",
        "q = replace(cfg, method='ar')",
        "r = ConfigError('smc needs a draft; choose from ar-greedy, smc-nN-kK[-keep]')",
        "s = row.particles and x == 'bank'",
        "t = table['draft_tokens']",
        "u = tuned == 'always'",  # not a trait of the table it is given (traits below)
        "def f(sandbox='auto', backend='auto'):\n    pass",
        "class Loaded:\n    model: DecoderModel\n    ngram: bool = False",
        "v = LoadedModel(model=m, ngram=True)",
        "w = {'model': name, 'object': 'model'}",
        "x = f'{name}-{setting}'",
        "y = '-' in name or name.split('-')",
        "z = getattr(args, 'min_ess', 1.0)",
        "key = ('ar', span, *consts)",
        'def f():\n    """Parses ``smc-n8-k2-keep`` and ``ar-bon-n4``."""',
    ]
    for code in flagged:
        assert method_switches(code, {"DRAFT": "ngram"}, traits={"tuned"}), code
    for code in plain:
        traits = set() if code.startswith("u = ") else {"tuned"}
        assert method_switches(code, {"DRAFT": "ngram"}, traits=traits) == [], code


DC25221_SWITCHES = [
    # Choice.tuned's values, each standing for one choice: the old name == "auto" switches
    ("cli/bench.py:36", "compares a trait's value",
     "always_tuned = any(c is not None and c.tuned == 'always' for _, c in listed)"),
    ("cli/bench.py:146", "compares a trait's value", "if tuned == 'always':\n    pass"),
    ("cli/bench.py:150", "compares a trait's value",
     "if tuned == 'without_nk' and tunes and args.grid is None and tuning is not None:\n"
     "    pass"),
    ("cli/engine_args.py:96", "compares a trait's value",
     "how = '--method auto' if method.tuned == 'always' else 'smc without -N/-K'"),
    ("tuning/tuner.py:85", "compares a trait's value", "if wanted.tuned == 'never':\n    pass"),
    ("tuning/predict.py:685", "compares a trait's value",
     "if wanted.tuned == 'never':\n    pass"),
    # Tuning's picks, a field per choice, each filled by name
    ("tuning/tuner.py:68", "names a field after a name", "class Tuning:\n    auto: Prediction"),
    ("tuning/tuner.py:69", "names a field after a name",
     "class Tuning:\n    smc: Prediction | None"),
    ("tuning/tuner.py:195", "keys by a name", "Tuning(predictions=predictions, auto=best)"),
    ("tuning/tuner.py:197", "passes a name", "auto = choose(predictions, 'auto', tie=tie)"),
    ("tuning/tuner.py:198", "passes a name",
     "smc = choose(predictions, 'smc', tie=tie) if with_draft else None"),
    ("tuning/tuner.py:98", "defaults to a name",
     "def config(self, base=None, method: str = 'auto'):\n    pass"),
    ("tuning/predict.py:644", "defaults to a name",
     "def choose(predictions, method: str = 'auto'):\n    pass"),
    ("tuning/table.py:147", "passes a name", "marks.append('auto')"),
    # the server's rule: a masked request on an n-gram default runs ar
    ("server/completions.py:179", "sets a method by name under a condition",
     "if masked and 'method' not in updates:\n    return replace(cfg, method='ar', draft='model')"),
    ("server/completions.py:182", "sets a method by name under a condition",
     "if masked or (named is not None and named.particles):\n"
     "    return replace(cfg, draft='model')"),
    # setting labels parsed and formatted outside one grammar
    ("eval/harness.py:102", "parses a setting label",
     r"_BASELINES = re.compile(r'ar-(?:(?P<greedy>greedy)|(?P<select>sc|bon)-n(?P<n>\d+))')"),
    ("eval/harness.py:103", "parses a setting label",
     r"_PARTICLE_SUFFIX = re.compile(r'(?P<keep>-keep)?(?:-a(?P<alpha>[\d.]+))?(?P<reward>"
     r"-reward(?P<beta>[\d.]+)?)?(?:-g(?P<groups>\d+))?(?P<ess>-ess)?"
     r"(?:-eps(?P<eps>[\d.]+))?(?P<vote>-vote)?')"),
    ("eval/report.py:248", "parses a setting label",
     "steered = [m for m in by_method if '-reward' in m]"),
    ("eval/report.py:249", "parses a setting label",
     "best_of = [m for m in by_method if m.startswith('ar-bon-n')]"),
    ("tuning/predict.py:120", "formats a setting label",
     "return f'{label}-ess' if self.cut else label"),
    ("tuning/predict.py:98", "defaults to a name", "class Setting:\n    draft: str = 'model'"),
    # the baseline named by a string
    ("eval/report.py:102", "defaults to a name",
     "def summarize(records, baseline: str = 'ar'):\n    pass"),
    ("eval/report.py:301", "defaults to a name",
     "def write_report(rows, out_dir, title, baseline: str = 'ar'):\n    pass"),
    ("eval/throughput.py:137", "defaults to a name",
     "def summarize_bench(records, baseline: str = 'ar'):\n    pass"),
    # a stats field read by name: smc's, by duck typing
    ("eval/fidelity.py:124", "reads a stats field by name",
     "log_z = getattr(out.stats, 'log_normalizer', None)"),
]  # fmt: skip
"""dc25221's method switches outside the table that the guard above could not see (it
passed there), each ``(site, kind, code)`` as it stood (comments cut): issue 86's 15 sites
(``cli/bench.py`` 36, 146, 150, ``cli/engine_args.py:96``, ``tuning/tuner.py:85``,
``tuning/predict.py:685``; ``Tuning.auto``/``.smc`` filled by ``choose(..., "auto"/"smc")``;
``server/completions.py:179``; the labels of ``eval/harness.py`` 102-103, ``eval/report.py``
248-249 and ``tuning/predict.py:120``; ``baseline="ar"`` in ``eval/report.py`` and
``eval/throughput.py``; ``eval/fidelity.py:124``) spelled out, and what else the widened scan
found there: the defaults naming ``auto`` and ``model``, ``marks.append("auto")``, the
server's second branch. ``git archive dc25221 src/smcspec`` scanned with
:func:`switches_under` gives these 26 sites and nothing else (``tuned``: the trait dc25221's
registry annotated ``str``)."""


@pytest.mark.parametrize(
    "site, kind, code", DC25221_SWITCHES, ids=[s for s, _, _ in DC25221_SWITCHES]
)
def test_the_scan_sees_each_spelling_of_dc25221(site, kind, code):
    """Each of dc25221's spellings is flagged, as the kind it is."""
    code = "def _():\n" + "\n".join("    " + line for line in code.split("\n"))
    hits = method_switches(code, {}, traits={"tuned"})
    assert kind in {k for _, k, _ in hits}, hits


def test_the_defaults_kept_beside_the_table_agree_with_it():
    """``config.py`` sits below ``decoding/``, so what a config resolves when it is made stays
    data there: each method's default N (more than 1 exactly where its decoder weighs
    particles) and the drafts, each of which the table's rows name."""
    assert set(METHOD_PARTICLES) == set(METHODS) == set(BY_METHOD)
    for method, n in METHOD_PARTICLES.items():
        assert (n > 1) == BY_METHOD[method].particles, method
    assert {d.draft.name for d in DECODERS.values()} == set(DRAFT_KINDS)
    assert all(d.draft is DRAFT_KINDS[d.draft.name] for d in DECODERS.values())
    assert not BASELINE.draft_tokens and not BASELINE.uses_n


@pytest.mark.parametrize(
    "kwargs, name, ran_as",
    [
        ({"method": "ar"}, "ar", None),
        ({"method": "sd", "draft_tokens": 3}, "sd", None),
        ({"method": "sd", "draft": "ngram", "draft_tokens": 5}, "ngram-sd", None),
        ({"method": "smc", "particles": 6, "draft_tokens": 2}, "smc", None),
        # greedy smc runs as greedy sd, and says so
        ({"method": "smc", "temperature": 0.0, "draft_tokens": 2}, "sd", "sd"),
        ({"method": "sd", "temperature": 0.0}, "sd", None),
        ({"method": "ar", "temperature": 0.0}, "ar", None),
    ],
)
def test_each_request_gets_its_decoder(kwargs, name, ran_as):
    """The decoder, and the method it ran as where that is not the requested one (the
    result's ``ran_as``; N and K are in its typed stats,
    :mod:`smcspec.decoding.decoder_stats`)."""
    cfg = GenerationConfig(**kwargs).validate()
    decoder = decoder_for(cfg)
    assert decoder is DECODERS[name]
    assert decoder.ran_as(cfg) == ran_as
    assert decoder.draft_model == (name in ("sd", "smc"))
    assert decoder.draft_tokens == (name != "ar")


@pytest.mark.parametrize("name", list(DECODERS))
def test_each_program_returns_the_stats_class_its_row_names(name):
    """A row's ``stats_class`` is the class of the stats its program returns (the guard above
    reads the stats classes from the rows). Broken variant: the ``ngram-sd`` row naming
    ``SmcStats`` fails here (its program returns ``SdStats``)."""
    decoder = DECODERS[name]
    cfg = decoder.configure(GenerationConfig(max_new_tokens=4, temperature=1.0), n=2, k=2)
    cfg = cfg.validate()
    assert decoder_for(cfg) is decoder
    target = tiny_transformer(seed=1, vocab=8)
    draft = tiny_transformer(seed=2, vocab=8) if decoder.draft_model else None
    job = job_for(target, draft, [1, 2, 0], cfg, frozenset(), 8, torch.Generator().manual_seed(0))
    out = run_program(decoder.program(job))
    assert type(out.stats) is decoder.stats_class


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("draft", list(DRAFT_KINDS))
@pytest.mark.parametrize("n", [1, 2, 4])
def test_a_config_and_a_tuner_setting_get_the_same_decoder(method, draft, n):
    """One rule picks a sampling request's decoder and a tuner setting's
    (:func:`decoder_for`, :func:`decoder_named`): wherever both answer, the same row."""
    try:
        cfg = GenerationConfig(method=method, draft=draft, particles=n, draft_tokens=2)
        from_config = decoder_for(cfg.validate())
        named = decoder_named(method, draft, n)
    except ConfigError:
        return  # refused (n-gram drafts for smc or ar, or with N >= 2 chains)
    assert from_config is named


def test_each_choice_says_how_its_setting_is_chosen():
    """A choice's behaviour, not a string standing for its name: when the tuner chooses its
    setting, among which decoders, whether it needs the draft model, how that is said."""
    rows = {
        name: (
            c.tuned, c.wants_tuning(None, None), c.wants_tuning(4, 2),
            c.wants_tuning(None, 2, True), c.needs_draft, c.loads_draft,
            sorted(d.name for d in DECODERS.values() if c.may_choose(d)),
        )
        for name, c in CHOICES.items()
    }  # fmt: skip
    every = sorted(DECODERS)
    assert rows == {
        "auto": (True, True, True, True, False, True, every),
        "smc": (True, True, False, False, True, False, ["smc"]),
        "sd": (False, False, False, False, False, False, []),
        "ar": (False, False, False, False, False, False, []),
    }
    assert CHOICES["auto"].chosen_by == "--method auto" and CHOICES["auto"].mark(4) == "auto"
    assert CHOICES["smc"].chosen_by == "smc without -N/-K"
    assert CHOICES["smc"].mark(4) == "smc (N >= 4)"


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("ar", Label(DECODERS["ar"])),
        ("sd-k4", Label(DECODERS["sd"], 1, 4)),
        ("sd-n8-k4", Label(DECODERS["multi-sd"], 8, 4)),
        ("sd-ngram-k4", Label(DECODERS["ngram-sd"], 1, 4)),  # the longest row that fits
        ("smc-n8-k2", Label(DECODERS["smc"], 8, 2)),
        ("smc-n8-k8-ess", Label(DECODERS["smc"], 8, 8, ess=True)),
        ("smc-n8-k2-reward-vote", Label(DECODERS["smc"], 8, 2, reward=True, vote=True)),
        ("smc-n8-k2-keep-a2-reward5-g4-ess-eps0.01-vote",
         Label(DECODERS["smc"], 8, 2, keep=True, alpha=2.0, reward=True, beta=5.0, groups=4,
               ess=True, eps=0.01, vote=True)),
        ("ar-greedy", Label(BASELINE, greedy=True)),
        ("ar-sc-n4", Label(BASELINE, samples=4, select="sc")),
        ("ar-bon-n3", Label(BASELINE, samples=3, select="bon")),
        # not labels: bare methods (a grid), bench's chosen names, others' names, suffixes
        # on a decoder without particles, suffixes out of order
        ("sd", None), ("smc", None), ("auto-ar", None), ("smc-n8-k8-unshared", None),
        ("sd-k4-keep", None), ("smc-n8-k2-vote-keep", None), ("ar-bon-nX", None),
    ],
)  # fmt: skip
def test_setting_labels_parse_and_format_as_one_grammar(text, parsed):
    """``decoding/labels.py`` is the one grammar: each label parses to its setting and
    formats back to itself; what is not a label parses to None."""
    assert parse_label(text) == parsed
    if parsed is not None:
        assert parsed.text == text
        assert parsed.best_of_n == text.startswith("ar-bon-")


def test_the_tuner_names_settings_in_the_grammar():
    """Every row's setting label, cut rounds too, parses back to the row, N and K."""
    for d in DECODERS.values():
        n, k = (4 if d.uses_n else 1), (3 if d.draft_tokens else 0)
        for ess in (False, True) if d.particles else (False,):
            label = parse_label(setting_label(d, n, k, ess=ess))
            assert (label.decoder, label.particles, label.draft_tokens, label.ess) == (
                d, n, k, ess,
            )  # fmt: skip
    assert BASELINE_LABEL == BASELINE.label(1, 0) == "ar"


def test_a_request_that_cannot_draft_ngrams_leaves_the_servers_default():
    """The server's rule (:func:`without_default_ngram`): on an n-gram default, a masked
    request without a method runs ar with the draft model; one naming smc, or masked and
    naming a method, drafts with the model; one that names its draft keeps it."""
    server = GenerationConfig(method="sd", draft="ngram", draft_tokens=4)
    masked = GenerationConfig(method="sd", draft="ngram", constraint=Regex("[ab]+"))
    as_ar = without_default_ngram(masked, {})
    assert (as_ar.method, as_ar.draft) == ("ar", "model")
    assert without_default_ngram(masked, {"method": "sd"}).draft == "model"
    smc = GenerationConfig(method="smc", draft="ngram")
    assert without_default_ngram(smc, {"method": "smc"}).draft == "model"
    assert without_default_ngram(server, {}) is server
    assert without_default_ngram(server, {"method": "sd"}) is server
    assert without_default_ngram(masked, {"draft": "ngram"}) is masked
