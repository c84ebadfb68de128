"""Settings from measured costs: which method, N and K decode fastest on this machine.

The engine measures its two models' forward costs once (cached per machine, backend and
model pair, :mod:`smcspec.tuning.cache`), predicts tokens/s of every ``ar``, ``sd`` (K; N >= 2
chains: multi-draft, :mod:`smcspec.tuning.multi_draft`) and ``smc`` (N, K; block rounds or cut
where the ESS falls) setting with the roofline (:mod:`smcspec.tuning.predict`), and chooses::

    from smcspec import Engine
    from smcspec.tuning import tune
    engine = Engine.load()
    tuning = tune(engine, min_particles=4)
    best = tuning.pick("auto")              # the fastest of all
    print(best.setting.name, best.tokens_per_second)
    cfg = tuning.config(method="smc")       # the fastest smc setting with N >= 4

``--method auto`` on the command line uses ``tuning.pick("auto")``; ``smc`` without
``-N``/``-K`` uses ``tuning.pick("smc")`` (``Tuning.picks``: each chosen setting by its
:class:`~smcspec.decoding.registry.Choice`); ``smcspec bench --predict`` prints the table
(:func:`smcspec.tuning.table.format_table`). The pair's acceptance is measured on four
built-in prompts; ``tune(engine, calibration=read_calibration("prompts.txt"))`` (the CLI's
``--calibration FILE``) measures it on the user's own (:mod:`smcspec.tuning.calibration`).
"""

from smcspec.tuning.calibration import Calibration, read_calibration
from smcspec.tuning.grid import TuningGrid, default_grid
from smcspec.tuning.predict import (
    ForwardCosts,
    Prediction,
    Setting,
    alpha_from_counts,
    choose,
    predict,
    predict_all,
    sd_tokens_per_round,
)
from smcspec.tuning.table import format_table
from smcspec.tuning.tuner import Tuning, tune

__all__ = [
    "Calibration",
    "ForwardCosts",
    "Prediction",
    "Setting",
    "Tuning",
    "TuningGrid",
    "alpha_from_counts",
    "choose",
    "default_grid",
    "format_table",
    "predict",
    "predict_all",
    "read_calibration",
    "sd_tokens_per_round",
    "tune",
]
