"""Tests of GenerationConfig.validate()."""

from __future__ import annotations

import dataclasses
import math

import pytest

from smcspec.config import MAX_DRAFT_TOKENS, MAX_PARTICLES, METHODS, GenerationConfig
from smcspec.decoding.registry import decoder_for
from smcspec.errors import ConfigError, SmcspecError
from smcspec.potentials import Reward
from smcspec.sampling.resampling import RESAMPLERS


def test_defaults_validate():
    cfg = GenerationConfig()
    assert cfg.validate() is cfg
    # the SMC-SD authors' defaults (shared/docs/smc-sd.md)
    assert (cfg.method, cfg.particles, cfg.draft_tokens) == ("smc", 4, 4)
    assert (cfg.alpha, cfg.ess_threshold, cfg.resampler) == (1.0, 0.5, "systematic")


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        GenerationConfig().particles = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"particles": 1},
        {"particles": MAX_PARTICLES},
        {"draft_tokens": 1},
        {"draft_tokens": MAX_DRAFT_TOKENS},
        {"max_new_tokens": 1},
        {"temperature": 1e-3, "draft_temperature": 5.0},
        {"temperature": 1},  # an int temperature is fine
        {"alpha": 0.25},
        {"alpha": 4.0},
        {"ess_threshold": 0.0},
        {"ess_threshold": 1.0},
        {"ess_threshold": 1},
        {"seed": 0, "return_particles": True, "stop_token_ids": (2, 7)},
        {"top_k": 0},
        {"top_k": -1},
        {"top_k": 1},
        {"top_k": 1_000_000},  # more than the vocabulary: keeps everything
        {"top_p": 1},
        {"top_p": 1e-6},
        {"top_p": 0.9},
        {"min_p": 0},
        {"min_p": 0.05},
        {"min_p": 1.0},
        {"top_k": 40, "top_p": 0.95, "min_p": 0.1},
    ]
    + [{"method": m} for m in METHODS]
    + [{"resampler": r} for r in RESAMPLERS],
)
def test_valid_values_pass(kwargs):
    cfg = GenerationConfig(**kwargs)
    assert cfg.validate() is cfg


@pytest.mark.parametrize(
    "kwargs",
    [
        {"particles": 0},
        {"particles": -1},
        {"particles": MAX_PARTICLES + 1},
        {"particles": 4.0},
        {"draft_tokens": 0},
        {"draft_tokens": MAX_DRAFT_TOKENS + 1},
        {"temperature": -0.7},
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"temperature": "0.7"},
        {"draft_temperature": 0.0},
        {"draft_temperature": -1.0},
        {"draft_temperature": math.nan},
        {"alpha": 0.0},
        {"alpha": -1.0},
        {"alpha": math.nan},
        {"alpha": math.inf},
        {"ess_threshold": -0.1},
        {"ess_threshold": 1.5},
        {"ess_threshold": math.nan},
        {"resampler": "bogus"},
        {"resampler": "Systematic"},
        {"temperature": 0, "method": "smc", "reward": Reward(lambda texts: [0.0] * len(texts))},
        {"method": "beam"},
        {"method": ""},
        {"max_new_tokens": 0},
        {"max_new_tokens": -5},
        {"max_new_tokens": 10.0},
        {"top_k": -2},
        {"top_k": 2.0},
        {"top_k": True},
        {"top_k": None},
        {"top_p": 0.0},
        {"top_p": 0},
        {"top_p": -0.5},
        {"top_p": 1.5},
        {"top_p": math.nan},
        {"top_p": math.inf},
        {"top_p": True},
        {"top_p": "0.9"},
        {"top_p": None},
        {"min_p": -0.1},
        {"min_p": 1.01},
        {"min_p": math.nan},
        {"min_p": -math.inf},
        {"min_p": False},
    ],
)
def test_bad_values_raise_config_error(kwargs):
    """Each is refused by ``validate`` or, for what a method allows, by the decoder table
    (:func:`~smcspec.decoding.registry.decoder_for`, which the engine runs on every request)."""
    with pytest.raises(ConfigError):
        decoder_for(GenerationConfig(**kwargs).validate())


def test_config_error_is_a_user_facing_value_error():
    with pytest.raises(ConfigError) as info:
        GenerationConfig(particles=0).validate()
    assert isinstance(info.value, SmcspecError) and isinstance(info.value, ValueError)
    assert info.value.exit_code == 2
    assert "particles" in str(info.value)


def test_truncation_defaults_are_off_and_errors_name_the_field():
    cfg = GenerationConfig()
    assert (cfg.top_k, cfg.top_p, cfg.min_p) == (0, 1.0, 0.0)
    for kwargs, name in (
        ({"top_k": -3}, "top_k"),
        ({"top_p": 0}, "top_p"),
        ({"min_p": 2}, "min_p"),
    ):
        with pytest.raises(ConfigError, match=name):
            GenerationConfig(**kwargs).validate()


def _other_value(f):
    """A valid value of CLI field ``f`` other than its default, and its argv."""
    opt = f.metadata["option"]
    flag = "--" + f.name.replace("_", "-")
    if f.default is True:
        return False, ["--no-" + f.name.replace("_", "-")]
    if opt.choices is not None:
        return opt.choices[-1], [flag, opt.choices[-1]]
    if f.name == "groups":  # it must divide N, and needs -N where N would be chosen
        return 2, [flag, "2", "-N", "4"]
    if f.type in ("int", "int | None"):
        return 5, [flag, "5"]
    if f.default is None:  # "float | None": unset means the setting's own default
        return 0.35, [flag, "0.35"]
    value = 0.9 if f.default == 1.0 else round(f.default + 0.05, 2)
    return value, [flag, str(value)]


def test_every_cli_setting_has_a_flag_that_reaches_the_config():
    """Settings are declared once (config.py): each field carrying an Option is a flag of
    generate, serve, bench and eval, with the field's default, and a value given on the
    command line arrives in the GenerationConfig."""
    from smcspec.cli.options import cli_fields

    fields = cli_fields()
    assert len(fields) >= 12
    defaults = _cli_config(["generate", "x"])
    for f in fields:
        assert getattr(defaults, f.name) == f.default, f.name
        value, argv = _other_value(f)
        for command in (["generate", "x"], ["serve"], ["bench"], ["eval", "gsm8k"]):
            cfg = _cli_config([*command, *argv])
            assert getattr(cfg, f.name) == value, (command, f.name)


def _cli_config(argv: list[str]) -> GenerationConfig:
    """The config a command line describes, as its command's ``run`` makes it."""
    from smcspec.cli import parse_args
    from smcspec.cli.options import config_from_args, method_args

    args = parse_args(argv)
    return config_from_args(args, method_args(args))


def test_groups_need_the_particles_they_divide():
    with pytest.raises(ConfigError, match="--groups needs -N"):
        _cli_config(["generate", "x", "--groups", "2"])
    with pytest.raises(ConfigError, match="must divide"):
        _cli_config(["generate", "x", "--groups", "3", "-N", "8"])
    cfg = _cli_config(["generate", "x", "--groups", "4", "-N", "8"])
    assert (cfg.groups, cfg.particles) == (4, 8)


def test_every_server_setting_is_a_field_of_the_smc_object():
    """Each field marked ``server`` is an optional field of the request's ``smc`` object, and
    nothing else is there but the constraint strings and the vote's settings."""
    from smcspec.server.schemas import SmcOptions

    marked = {f.name for f in dataclasses.fields(GenerationConfig) if f.metadata.get("server")}
    assert {"method", "particles", "draft_tokens", "alpha", "draft_p_min"} <= marked
    extras = {"regex", "grammar", "aggregate", "answer_regex"}
    assert set(SmcOptions.model_fields) == marked | extras
    for name in marked:
        assert SmcOptions.model_fields[name].default is None
