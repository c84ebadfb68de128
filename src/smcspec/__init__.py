"""smcspec: LLM inference with SMC speculative decoding.

Emara et al. 2026, "Faster LLM Inference via Sequential Monte Carlo" (arXiv:2604.15672).
"""

from smcspec.config import GenerationConfig
from smcspec.engine import Engine, GenerationResult
from smcspec.errors import (
    ConfigError,
    ContextLengthError,
    ModelFileError,
    NumericalError,
    SmcspecError,
)
from smcspec.potentials import (
    Constraint,
    ConstraintState,
    DeadEndError,
    Grammar,
    JsonSchema,
    Regex,
    Reward,
    TokenConstraint,
)

__version__ = "0.1.0"
__all__ = [
    "ConfigError",
    "Constraint",
    "ConstraintState",
    "DeadEndError",
    "Grammar",
    "JsonSchema",
    "Regex",
    "Reward",
    "TokenConstraint",
    "ContextLengthError",
    "Engine",
    "GenerationConfig",
    "GenerationResult",
    "ModelFileError",
    "NumericalError",
    "SmcspecError",
    "__version__",
]
