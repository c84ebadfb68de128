"""The decoder table: which decoder runs a request is decided in one place, and no code outside
``decoding/registry.py`` switches on a method's, a draft's or a decoder's name."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest
import torch
from enumerable import tiny_transformer

import smcspec
from smcspec import GenerationConfig
from smcspec.config import DRAFT_KINDS, METHOD_PARTICLES, METHODS
from smcspec.decoding.job import job_for
from smcspec.decoding.program import run_program
from smcspec.decoding.registry import BASELINE, BY_METHOD, CHOICES, DECODERS, decoder_for

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

TABLES = {"DECODERS", "BY_METHOD", "CHOICES"}
"""The registry's dicts keyed by a name: code outside asks its functions instead."""

NOT_METHODS = {
    ("backends/torch/transformer.py", "self.rounds == 'auto'"),  # how rounds run
    ("backends/torch/transformer.py", "mode == 'auto'"),  # which kernel set the layers run
    ("backends/torch/transformer.py", "self.kernel_mode != 'auto'"),
    ("models/loading.py", "backend == 'auto'"),  # which backend loads a file
    ("models/pair.py", "backend == 'auto'"),
    ("sandbox.py", "sandbox == 'auto'"),  # which sandbox runs code
    ("tool_calls/spec.py", "self.choice == 'auto'"),  # OpenAI's tool_choice
    ("tool_calls/spec.py", "self.choice in ('auto', 'required')"),
}
"""Comparisons with ``"auto"`` that are other settings' own value, not the method ``auto``:
each by file and expression (the same spelling elsewhere is flagged)."""


def _defined(path: Path, kind: type, suffix: str = "") -> set[str]:
    """Names of the module-level definitions of ``kind`` in ``path`` ending in ``suffix``."""
    body = ast.parse(path.read_text()).body
    return {n.name for n in body if isinstance(n, kind) and n.name.endswith(suffix)}


@functools.cache
def _lookups(root: Path) -> set[str]:
    """The registry's functions (``decoder_named``, ``choice``, ...): each takes a name."""
    return _defined(root / REGISTRY, ast.FunctionDef)


def _stats_classes() -> set[str]:
    """The decoders' stats classes (``ArStats``, ``SdStats``, ``SmcStats``): the ones the
    table's rows name (:attr:`~smcspec.decoding.registry.Decoder.stats_class`)."""
    return {d.stats_class.__name__ for d in DECODERS.values()}


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


class _Scan:
    """The method switches of one module (:func:`method_switches`)."""

    def __init__(self, strings: dict[str, str], lookups: set[str], stats: set[str]):
        self.strings, self.lookups, self.stats = strings, lookups, stats

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

    @staticmethod
    def named(node: ast.AST, names: set[str]) -> bool:
        """``node`` is a variable or an attribute called one of ``names``."""
        return (isinstance(node, ast.Name) and node.id in names) or (
            isinstance(node, ast.Attribute) and node.attr in names
        )

    def why(self, node: ast.AST) -> str | None:
        """What kind of switch ``node`` is, or None."""
        if isinstance(node, ast.Compare):
            sides = (node.left, *node.comparators)
            if any(self.names(s) for s in sides):
                return "compares a name"
            if any(self.named(s, {"method"}) for s in sides):
                return "compares a method"
            if any(self.named(c, TABLES) for c in node.comparators):
                return "looks a name up in the table's dicts"
            if any(self.named(s, self.stats) for s in sides):
                return "compares a stats class"
        elif isinstance(node, ast.Subscript):
            if self.named(node.value, TABLES):
                return "looks a name up in the table's dicts"
            if isinstance(node.slice, ast.Constant | ast.Name) and self.names(node.slice):
                return "looks a name up"
        elif isinstance(node, ast.Call):
            return self.why_call(node)
        elif isinstance(node, ast.MatchValue) and self.names(node.value):
            return "matches a name"
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
        return None


def method_switches(
    source: str | ast.Module, strings: dict[str, str], root: Path = SRC
) -> list[tuple]:
    """``(line, kind, expression)`` of every method switch in ``source``: a comparison
    (``==``, ``!=``, ``in``, ``not in``, ``is``) with a string, or a constant bound to one,
    that names a method (``ar``, ``sd``, ``smc``, ``auto``), a draft (``model``, ``ngram``) or
    a decoder (``multi-sd``, ``ngram-sd``), whatever the other side is called; a subscript
    or ``.get`` with such a key; a ``match`` case on one; a registry function given one
    (``decoder_named("ar")``); a comparison of a ``method`` variable or ``.method``
    attribute with anything; any lookup in the table's dicts (``BY_METHOD[x]``, ``x in
    BY_METHOD``); and a type switch on a decoder's stats class (``isinstance(s, SmcStats)``).
    ``source``: its text or tree; ``strings``: the module's constants (:func:`_strings`)."""
    scan = _Scan(strings, _lookups(root), _stats_classes())
    tree = ast.parse(source) if isinstance(source, str) else source
    out = []
    for node in ast.walk(tree):
        kind = scan.why(node)
        if kind is not None:
            out.append((node.lineno, kind, ast.unparse(node)))
    return sorted(out)


def switches_under(root: Path) -> dict[str, list[tuple]]:
    """:func:`method_switches` of every module under ``root`` (a copy of ``src/smcspec``),
    outside ``decoding/registry.py`` and the :data:`NOT_METHODS` comparisons."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        if rel == REGISTRY:
            continue
        tree = ast.parse(path.read_text())
        hits = [
            h
            for h in method_switches(tree, _strings(tree, root), root)
            if (rel, h[2]) not in NOT_METHODS
        ]
        if hits:
            found[rel] = hits
    return found


def test_methods_are_named_in_the_registry_only():
    """Everything that differs between methods and drafts is the decoder table's
    (``decoding/registry.py``): elsewhere code asks the table (a decoder's traits, its round,
    its name), never compares or looks up a name. Fails on cb48c1a with each of the 18
    switches of issue 75 (:data:`CB48C1A_SWITCHES`), and on any new one."""
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
    ]
    plain = [
        "p = f'smc-n{n}'",
        "q = replace(cfg, method='ar')",
        "r = ConfigError('smc needs a draft')",
        "s = row.particles and x == 'bank'",
        "t = table['draft_tokens']",
    ]
    source = "\n".join(flagged + plain)
    found = {line for line, _, _ in method_switches(source, {"DRAFT": "ngram"})}
    match_case = len(flagged) + 1  # the last of flagged: its case's line
    assert found == set(range(1, len(flagged))) | {match_case}


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
