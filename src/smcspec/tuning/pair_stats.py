"""The model pair's acceptance statistics, kept apart from the machine's forward costs.

What the tuner predicts from the pair, not from the machine: sd's per-token acceptance
``alpha`` (Leviathan et al. 2023), the quantiles of SMC-SD's per-token log-weight
``log p_T(x) - log q_T(x)`` (the fidelity prediction, :func:`~smcspec.tuning.predict.predicted_ess`)
and both models' agreement profiles (:class:`smcspec.tuning.measure.Acceptance`). They depend on
the two models' weights and the sampling settings only, so they are measured once with the real
weights wherever those run (a CPU) and reused where only costs can be measured: a GPU lent
without the weights (``benchmarks/gpu_campaign.py``), or the same pair on another device.

Two ways in:

- :func:`find_cached_acceptance`: the cost cache of another machine or device of *the same
  files* (:mod:`smcspec.tuning.cache`; the key's ``target`` and ``draft`` identities equal)
  already holds them: the tuner copies them instead of measuring again.
- a pair-stats file, written by :func:`write_pair_stats` (``smcspec bench --predict
  --export-pair-stats FILE``) and read by :func:`read_pair_stats` (``--pair-stats FILE``):
  JSON ``{"format": 1, "kind": "smcspec-pair-stats", "target": {"name", "bytes"}, "draft":
  {...}, "measured_on": machine, "acceptance": {sampling key: measurement}}`` (a measurement's
  ``tree_rejection`` and ``tree_continuing``, multi-draft sd's, are optional: :data:`TREE`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smcspec.errors import ConfigError
from smcspec.input_files import loads_bounded, read_text_file
from smcspec.models.loading import cache_root
from smcspec.tuning.measure import QUANTILES

PAIR_STATS_FORMAT = 1
PAIR_STATS_KIND = "smcspec-pair-stats"
REQUIRED = ("alpha", "accepted", "drafted", "rounds", "log_weight_quantiles",
            "draft_top_probs", "target_top_probs")  # fmt: skip
"""The fields of a measurement the predictions read (the last three are None at temperature
0: greedy decoding has no weights)."""


@dataclass(frozen=True)
class PairStats:
    """A pair's acceptance statistics read from a file (:func:`read_pair_stats`).

    Attributes:
        target, draft: ``{"name": file name, "bytes": size}`` of the models measured.
        measured_on: the machine that measured them (for reports).
        acceptance: per sampling key (:func:`smcspec.tuning.cache.sampling_key`), one
            measurement (the fields of :class:`smcspec.tuning.measure.Acceptance`).
        source: the file read.
    """

    target: Mapping[str, Any]
    draft: Mapping[str, Any]
    measured_on: str
    acceptance: Mapping[str, Mapping[str, Any]]
    source: Path

    @property
    def pair(self) -> str:
        """``"<target name> / <draft name>"``."""
        return f"{self.target.get('name')} / {self.draft.get('name')}"

    def for_sampling(self, acc_key: str) -> dict[str, Any]:
        """The measurement at sampling key ``acc_key``.

        Raises:
            ConfigError: the file holds none at these temperatures and filters (the message
                lists the keys it holds).
        """
        if acc_key not in self.acceptance:
            held = "; ".join(sorted(self.acceptance)) or "none"
            raise ConfigError(
                f"{self.source} holds no acceptance statistics at {acc_key} (it holds: {held}); "
                "measure them at these sampling settings where the weights are "
                "(smcspec bench --predict --export-pair-stats FILE)"
            )
        return dict(self.acceptance[acc_key])


TREE = ("tree_rejection", "tree_continuing")
"""Multi-draft sd's tree acceptance (:func:`smcspec.tuning.multi_draft.tree_acceptance`;
None at temperature 0). Optional in a pair-stats file (files written before it was measured
predict no multi-draft setting); a cached measurement without it is measured again."""


def _has_fields(measurement: Mapping[str, Any]) -> bool:
    return all(f in measurement for f in REQUIRED)


def complete(measurement: Mapping[str, Any] | None, prompts: int) -> bool:
    """Whether ``measurement`` holds every field the predictions read (the tree acceptance
    too where it has log-weights), pooled over at least ``prompts`` calibration prompts
    (older caches lack the profiles, the tree acceptance or the pooling)."""
    if not measurement or not _has_fields(measurement):
        return False
    sampled = measurement.get("log_weight_quantiles") is not None
    if sampled and any(measurement.get(f) is None for f in TREE):
        return False
    return measurement.get("prompts", 1) >= prompts


def _check_tree(acc_key: str, m: Mapping[str, Any]) -> None:
    """The tree acceptance, where present: non-increasing probabilities, and rows of
    continuing-chain probabilities (row ``m`` of ``m`` entries) that sum to 1."""
    rejection, continuing = m.get("tree_rejection"), m.get("tree_continuing")
    if rejection is None and continuing is None:
        return
    ok = (
        isinstance(rejection, list) and rejection and isinstance(continuing, list)
        and len(continuing) == len(rejection)
        and all(isinstance(v, int | float) and 0 <= v <= 1 for v in rejection)
        and all(b <= a + 1e-9 for a, b in zip(rejection, rejection[1:], strict=False))
        and all(
            isinstance(row, list) and len(row) == i + 1 and all(0 <= v <= 1 for v in row)
            and abs(sum(row) - 1) <= 1e-3
            for i, row in enumerate(continuing)
        )
    )  # fmt: skip
    if not ok:
        raise ValueError(
            f"{acc_key}: tree_rejection must be non-increasing probabilities and "
            "tree_continuing one probability row per chain count, each summing to 1"
        )


def _check(acc_key: str, m: Any) -> None:
    if not isinstance(m, dict) or not _has_fields(m):
        raise ValueError(f"{acc_key}: needs the fields {', '.join(REQUIRED)}")
    _check_tree(acc_key, m)
    if not 0 <= m["alpha"] <= 1:
        raise ValueError(f"{acc_key}: alpha {m['alpha']!r} is not in [0, 1]")
    q = m["log_weight_quantiles"]
    if q is None:  # greedy: no weights, no profiles
        return
    if len(q) != QUANTILES or not all(isinstance(x, int | float) and math.isfinite(x) for x in q):
        raise ValueError(f"{acc_key}: log_weight_quantiles must be {QUANTILES} finite numbers")
    if any(b < a for a, b in zip(q, q[1:], strict=False)):
        raise ValueError(f"{acc_key}: log_weight_quantiles must not decrease")
    for name in ("draft_top_probs", "target_top_probs"):
        rows = m[name]
        if not rows or not all(
            isinstance(r, list) and r and all(0 <= p <= 1 for p in r) and sum(r) <= 1 + 1e-3
            for r in rows
        ):
            raise ValueError(f"{acc_key}: {name} must be lists of probabilities")


MAX_PAIR_STATS_BYTES = 16 << 20  # a pair-stats file is tens of KB; larger is refused unread

def read_pair_stats(path: str | Path) -> PairStats:
    """Read and check a pair-stats file.

    Raises:
        ConfigError: the file is missing, not a regular file, larger than
            :data:`MAX_PAIR_STATS_BYTES`, not JSON (or nested too deep), not a pair-stats
            file of this format, or
            a measurement in it is malformed (alpha outside [0, 1], decreasing quantiles,
            probabilities outside [0, 1], a field missing).
    """
    path = Path(path)
    text = read_text_file(path, "the pair statistics", MAX_PAIR_STATS_BYTES)
    data = loads_bounded(text, f"the pair statistics {path}")
    try:
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("kind") != PAIR_STATS_KIND or data.get("format") != PAIR_STATS_FORMAT:
            raise ValueError(f"not a {PAIR_STATS_KIND} file of format {PAIR_STATS_FORMAT}")
        acceptance = data["acceptance"]
        if not isinstance(acceptance, dict) or not acceptance:
            raise ValueError("no acceptance measurement")
        for acc_key, m in acceptance.items():
            _check(acc_key, m)
        return PairStats(
            target=dict(data["target"]),
            draft=dict(data["draft"]),
            measured_on=str(data["measured_on"]),
            acceptance=acceptance,
            source=path,
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path} is not a valid pair-statistics file: {exc}") from None


def write_pair_stats(
    path: str | Path,
    target: Path,
    draft: Path,
    measured_on: str,
    acceptance: Mapping[str, Mapping[str, Any]],
) -> Path:
    """Write ``acceptance`` (sampling key -> measurement) of the pair ``target``/``draft``
    (model files or folders) measured on ``measured_on``, atomically; returns the path.

    Raises:
        ConfigError: a measurement lacks a field the predictions read (measure it first), or
            the file cannot be written.
    """
    path = Path(path)
    for acc_key, m in acceptance.items():
        try:
            _check(acc_key, dict(m))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"cannot export the pair statistics: {exc}") from None
    data = {
        "kind": PAIR_STATS_KIND,
        "format": PAIR_STATS_FORMAT,
        "target": _identity(target),
        "draft": _identity(draft),
        "measured_on": measured_on,
        "acceptance": {k: dict(v) for k, v in acceptance.items()},
    }
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _identity(model: Path) -> dict[str, Any]:
    model = Path(model)
    size = model.stat().st_size if model.is_file() else None
    return {"name": model.name, "bytes": size}


def find_cached_acceptance(
    key: Mapping[str, Any], acc_key: str, prompts: int, root: Path | None = None
) -> tuple[dict[str, Any], str] | None:
    """A complete acceptance measurement at ``acc_key`` in another cost-cache file of the same
    model files (its key's ``target`` and ``draft`` equal ``key``'s: same paths, sizes and
    modification times), e.g. the CPU's when the pair is now tuned on a GPU; with the machine
    it came from. None when no file has one (unreadable files are skipped)."""
    folder = (root or cache_root()) / "costs"
    for file in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        try:
            data = json.loads(file.read_text())
            other = data["key"]
            if other == key or (other["target"], other["draft"]) != (key["target"], key["draft"]):
                continue
            m = data.get("acceptance", {}).get(acc_key)
            if complete(m, prompts):
                _check(acc_key, m)
                where = f"{other.get('machine')}, {other.get('device')}"
                return dict(m), where
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return None
