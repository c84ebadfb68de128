"""Decoders: autoregressive (``ar``), exact speculative (``sd``) and SMC-SD (``smc``)."""

from smcspec.decoding.ar import decode_ar
from smcspec.decoding.common import DecodeOutput, ParticleOutput
from smcspec.decoding.sd import decode_sd
from smcspec.decoding.smc import decode_smc

__all__ = ["DecodeOutput", "ParticleOutput", "decode_ar", "decode_sd", "decode_smc"]
