"""What the tuner needs of a loaded model pair.

:class:`smcspec.engine.Engine` is one; the tuner only names this protocol, so the
dependency runs one way (the engine calls the tuner, the tuner never imports the engine).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from smcspec.config import GenerationConfig
    from smcspec.models.loading import LoadedModel


class TunablePair(Protocol):
    """A target (and optionally a draft) that can encode prompts and generate.

    Attributes:
        target, draft: the loaded models (``draft`` None: only ar can be predicted).
        tokenizer: the pair's Hugging Face tokenizer (its ``chat_template`` is read).
        vocab: token ids that may be sampled.
    """

    target: LoadedModel
    draft: LoadedModel | None
    tokenizer: Any
    vocab: int

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids of ``prompt`` (chat-templated when ``chat``)."""
        ...

    def generate(self, prompt: list[int], config: GenerationConfig) -> Any:
        """A result with ``stats`` and ``token_ids`` (the measuring sd run)."""
        ...
