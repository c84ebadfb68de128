"""Setting labels: the one grammar of the names settings carry in reports, in ``eval``'s and
``bench``'s ``--methods`` and in the tuner's table, parsed (:func:`parse_label`) and formatted
(:attr:`Label.text`, :func:`setting_label`, :func:`chosen_label`) here alone::

    label     := baseline | setting
    baseline  := B-greedy | B-sc-nN | B-bon-nN        B: the baseline's label (``ar``)
    setting   := row [suffixes]                       row: a decoder's label, the longest
                                                      that fits (``sd-k4``, ``sd-n4-k4``,
                                                      ``sd-ngram-k4``, ``smc-n8-k2``)
    suffixes  := [-keep][-aALPHA][-reward[BETA]][-gG][-ess][-epsEPS][-vote]
                                                      (a decoder that weighs particles only)

The rows' own parts (``smc-nN-kK``) are the decoder table's (each row's ``label`` and
``pattern``, :mod:`smcspec.decoding.registry`); this module adds what a setting says beyond
its decoder, N and K. ``ar-greedy`` samples greedily, ``ar-sc-nN`` and ``ar-bon-nN`` draw N
samples and keep the majority answer or the best by the task's reward; the suffixes set
SMC-SD's options (:func:`smcspec.eval.harness.method_specs` applies them). A bare method
(``ar``, ``sd``, ``smc``) is not a label: ``eval`` runs it over its grid of N and K.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from smcspec.decoding.registry import BASELINE, DECODERS, Choice, Decoder

SELF_CONSISTENCY = "sc"
"""A baseline's selection: the majority answer of its N samples (``ar-sc-nN``)."""

BEST_OF = "bon"
"""A baseline's selection: the best of its N samples by the task's reward (``ar-bon-nN``)."""

_BASELINE = re.compile(
    re.escape(BASELINE.label(1, 0))
    + rf"-(?:(?P<greedy>greedy)|(?P<select>{SELF_CONSISTENCY}|{BEST_OF})-n(?P<n>\d+))"
)
_SUFFIXES = re.compile(
    r"(?P<keep>-keep)?(?:-a(?P<alpha>[\d.]+))?(?P<reward>-reward(?P<beta>[\d.]+)?)?"
    r"(?:-g(?P<groups>\d+))?(?P<ess>-ess)?(?:-eps(?P<eps>[\d.]+))?(?P<vote>-vote)?"
)

LABEL_HELP = (
    f"{BASELINE.label(1, 0)}, {BASELINE.label(1, 0)}-greedy, "
    f"{BASELINE.label(1, 0)}-{SELF_CONSISTENCY}-nN, {BASELINE.label(1, 0)}-{BEST_OF}-nN, "
    "sd, smc, sd-kK, sd-nN-kK, sd-ngram-kK, "
    "smc-nN-kK[-keep][-aALPHA][-reward[BETA]][-gG][-ess][-epsEPS][-vote]"
)
"""What ``--methods`` accepts, for its error message."""


@dataclass(frozen=True)
class Label:
    """One setting's label, parsed.

    Attributes:
        decoder: the decoder it runs on (a baseline: :data:`~smcspec.decoding.registry.BASELINE`).
        particles, draft_tokens: N and K where the decoder's label names them (1 and 0
            otherwise).
        greedy: ``ar-greedy``: the baseline at temperature 0.
        samples: ``ar-sc-nN``/``ar-bon-nN``: N samples an item (1 otherwise).
        select: :data:`SELF_CONSISTENCY` or :data:`BEST_OF` for those, else None.
        keep: ``-keep``: finished particles ride on running ones (the paper's rule).
        alpha: ``-aALPHA``: the power target's alpha, else None.
        reward: ``-reward[BETA]``: steered by the task's reward; ``beta`` its number if given.
        groups: ``-gG``: G particle groups, else None.
        ess: ``-ess``: rounds cut where the ESS falls.
        eps: ``-epsEPS``: the epsilon stop, else None.
        vote: ``-vote``: the weighted vote answers.
    """

    decoder: Decoder
    particles: int = 1
    draft_tokens: int = 0
    greedy: bool = False
    samples: int = 1
    select: str | None = None
    keep: bool = False
    alpha: float | None = None
    reward: bool = False
    beta: float | None = None
    groups: int | None = None
    ess: bool = False
    eps: float | None = None
    vote: bool = False

    @property
    def baseline(self) -> bool:
        """It is one of the baseline's own forms (``ar-greedy``, ``ar-sc-nN``, ``ar-bon-nN``)."""
        return self.greedy or self.select is not None

    @property
    def best_of_n(self) -> bool:
        """It is a best-of-n baseline (``ar-bon-nN``): its samples reranked by the reward."""
        return self.select == BEST_OF

    @property
    def text(self) -> str:
        """The label as written (:func:`parse_label`'s inverse)."""
        own = self.decoder.label(self.particles, self.draft_tokens)
        if self.greedy:
            return f"{own}-greedy"
        if self.select is not None:
            return f"{own}-{self.select}-n{self.samples}"
        parts = [own]
        parts += ["keep"] if self.keep else []
        parts += [f"a{self.alpha:g}"] if self.alpha is not None else []
        parts += [f"reward{'' if self.beta is None else f'{self.beta:g}'}"] if self.reward else []
        parts += [f"g{self.groups}"] if self.groups is not None else []
        parts += ["ess"] if self.ess else []
        parts += [f"eps{self.eps:g}"] if self.eps is not None else []
        parts += ["vote"] if self.vote else []
        return "-".join(parts)


def parse_label(text: str) -> Label | None:
    """The setting ``text`` names (``smc-n8-k2-keep``, ``sd-k4``, ``ar-bon-n4``), or None where
    it names none: no decoder's label fits the start (the longest wins: ``sd-ngram-k4`` is
    not ``sd``), or what follows is not the suffixes of a decoder that weighs particles.

    Raises:
        ValueError: a suffix's number that is not one (``-a1.2.3``).
    """
    if m := _BASELINE.fullmatch(text):
        if m.group("greedy"):
            return Label(BASELINE, greedy=True)
        return Label(BASELINE, samples=int(m.group("n")), select=m.group("select"))
    found = []
    for d in DECODERS.values():
        m = d.pattern.match(text)
        if m is not None and (m.end() == len(text) or text[m.end()] == "-"):
            found.append((m.end(), d, m.groupdict()))
    if not found:
        return None
    end, d, groups = max(found, key=lambda f: f[0])
    n, k = int(groups.get("n") or 1), int(groups.get("k") or 0)
    rest = text[end:]
    if not d.particles:
        return Label(d, n, k) if not rest else None
    s = _SUFFIXES.fullmatch(rest)
    if s is None:
        return None
    return Label(
        d, n, k,
        keep=bool(s.group("keep")),
        alpha=float(s.group("alpha")) if s.group("alpha") else None,
        reward=bool(s.group("reward")),
        beta=float(s.group("beta")) if s.group("beta") else None,
        groups=int(s.group("groups")) if s.group("groups") else None,
        ess=bool(s.group("ess")),
        eps=float(s.group("eps")) if s.group("eps") else None,
        vote=bool(s.group("vote")),
    )  # fmt: skip


def setting_label(decoder: Decoder, particles: int = 1, draft_tokens: int = 0, *,
                  ess: bool = False) -> str:  # fmt: skip
    """The label of ``decoder`` at N = ``particles``, K = ``draft_tokens`` (``ess``: its rounds
    cut where the ESS falls): ``ar``, ``sd-k4``, ``sd-n4-k4``, ``sd-ngram-k4``,
    ``smc-n8-k8-ess``."""
    return Label(decoder, particles, draft_tokens, ess=ess).text


def chosen_label(choice: Choice, label: str) -> str:
    """The name ``bench`` gives the setting labelled ``label`` that the tuner chose for
    ``choice``: where the method was chosen too, the choice's name before it
    (``auto-smc-n8-k2``), else the label itself."""
    return f"{choice.name}-{label}" if choice.chooses_method else label


BASELINE_LABEL = setting_label(BASELINE)
"""The baseline's label (``ar``): the run reports pair every other setting with."""
