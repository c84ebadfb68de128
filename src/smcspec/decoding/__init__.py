"""Decoders: autoregressive (``ar``), exact speculative (``sd``, drafting with the draft
model or with n-grams of the text, :mod:`.sd.ngram`) and SMC-SD (``smc``).

Each is a program (a generator of forward requests, see :mod:`smcspec.decoding.program`);
``decode_*`` runs one on its own.
"""

from smcspec.decoding.ar.program import ar_program, decode_ar
from smcspec.decoding.output import DecodeOutput, ParticleOutput
from smcspec.decoding.program import Forward, Prefill, Program, run_program
from smcspec.decoding.sd.chain import decode_sd, sd_program
from smcspec.decoding.sd.ngram import decode_ngram_sd, ngram_sd_program
from smcspec.decoding.smc.program import decode_smc, smc_program

__all__ = [
    "DecodeOutput",
    "Forward",
    "ParticleOutput",
    "Prefill",
    "Program",
    "ar_program",
    "decode_ar",
    "decode_ngram_sd",
    "decode_sd",
    "decode_smc",
    "ngram_sd_program",
    "run_program",
    "sd_program",
    "smc_program",
]
