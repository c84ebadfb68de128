"""FP8 weights for the torch backend: a layer's projections read half the bytes of bf16.

Decoding at batch 1 is bound by reading the weights, so weights stored in one byte instead of
two halve the bound of every forward (issue 64's item 4: the 32B and 70B targets in FP8; a
70B in FP8 also leaves an H200 room for KV caches). :class:`Fp8Linear` keeps
a projection's weight ``W`` (``[out, in]``) as float8 e4m3 with one float32 scale per output
channel, ``W ~= s_w[:, None] * Q_w``, and computes ``y = x W^T`` as one scaled FP8 GEMM
(:func:`torch._scaled_mm`, CUTLASS's row-wise kernel on sm_90): the activations are
quantized per row on the fly (``s_x = max|x_row| / 448``), the product of the two scales is
applied inside the GEMM and the output comes back in bf16. Nothing reads a device value on
the host, so a captured round (:mod:`.graphs`) captures it as it is.

This is the "FP8 dynamic, per-channel weights and per-token activations" recipe (vLLM's
``fp8`` W8A8 with channel-wise weight scales; NVIDIA Transformer Engine's e4m3 format,
max 448). Only the four projections of each layer are converted: the embedding, the norms
and the output layer (whose logits set every sampling probability) stay in the model's dtype.

Accuracy: e4m3 keeps 3 mantissa bits, a relative rounding error of up to 2^-4 per element
of each operand; over a dot product the roundings partly average out (``tests/test_fp8.py``:
4.2% of the largest output of a 256-wide projection, 8.5% of the logits' spread of a 16-wide
model, random weights). With the real default pair, teacher-forced on 16 GSM8K answers
(``benchmarks/fp8_fidelity.py``, ``docs/benchmarks/fp8-fidelity/``): KL to the float32
distributions 0.0023 (target) and 0.0034 (draft) nats per token, the greedy token the same at
99.1% and 98.7% of positions. GSM8K accuracy with FP8 is not measured.
"""

from __future__ import annotations

import torch
from torch import nn

from smcspec.errors import ConfigError

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_EPS = 1e-12  # a row of zeros gets this scale (its quantized values are 0 anyway)
ALIGN = 16  # _scaled_mm's K and N must be multiples of 16


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row FP8 quantization: ``x ~= scale * q``.

    Args:
        x: ``[M, K]`` floating point.
    Returns:
        ``q`` float8_e4m3fn ``[M, K]`` and ``scale`` float32 ``[M, 1]`` (``max|x_row| / 448``).
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(_EPS) / FP8_MAX
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale  # clamp_: on the quotient


class Fp8Linear(nn.Module):
    """A linear layer whose weight is stored in FP8 (see the module docstring).

    Parameters (frozen): ``weight`` float8_e4m3fn ``[out, in]``, ``weight_scale`` float32
    ``[out]``, ``bias`` (the source's dtype) ``[out]`` or None.

    Args:
        weight: the quantized weight; weight_scale: its per-output-channel scales; bias: as
            :class:`torch.nn.Linear`'s.
    """

    def __init__(
        self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> Fp8Linear:
        """``layer``'s weight quantized per output channel (on its device, one layer's float32
        copy at a time).

        Raises:
            ConfigError: a dimension is not a multiple of 16 (the FP8 GEMM's requirement).
        """
        out_f, in_f = layer.weight.shape
        if out_f % ALIGN or in_f % ALIGN:
            raise ConfigError(
                f"FP8 weights need dimensions that are multiples of {ALIGN}; "
                f"this layer is {out_f} x {in_f}"
            )
        with torch.no_grad():
            q, scale = quantize_rows(layer.weight)
            bias = None if layer.bias is None else layer.bias.detach().clone()
        return cls(q, scale[:, 0].contiguous(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``y = x W^T + b``: ``x`` ``[..., in]`` (any float dtype) -> ``[..., out]`` in ``x``'s
        dtype. One FP8 GEMM with row-wise scales; the activations quantized per row."""
        flat = x.reshape(-1, x.shape[-1])
        q, sx = quantize_rows(flat)
        out = torch._scaled_mm(
            q,
            self.weight.t(),  # column-major, as the GEMM requires
            scale_a=sx,
            scale_b=self.weight_scale[None, :],
            out_dtype=torch.bfloat16,
        ).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


PROJECTIONS = ("qkv", "o", "gate_up", "down")
"""The layers of a :class:`~smcspec.backends.torch.transformer.Block` that FP8 converts."""


def fp8_supported(device: torch.device | str) -> bool:
    """Whether FP8 GEMMs run on ``device``: CPUs (PyTorch's reference kernel) and CUDA
    devices of compute capability 9.0 or later (Hopper, Blackwell: PyTorch's row-wise scaled
    GEMM is a CUTLASS kernel for sm_90; Ada's 8.9 has FP8 but not that kernel in every
    PyTorch build, so it is refused rather than left to fail at the first forward)."""
    device = torch.device(device)
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (9, 0)
    return False


def _bytes(layer: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def convert_to_fp8(model: nn.Module) -> int:
    """Replace the projections of every layer of ``model`` (a torch-backend
    :class:`~smcspec.backends.torch.transformer.Transformer`) by :class:`Fp8Linear`, one
    layer at a time (the peak memory is the model plus one layer's float32 copy); returns
    the bytes of parameters saved (the scales counted). The model drops its captured
    rounds (they replay the old layers); the next rounds are captured again.

    Raises:
        ConfigError: the device has no FP8 GEMM, or a dimension is not a multiple of 16.
    """
    if not fp8_supported(model.device):
        raise ConfigError(f"{model.device} has no FP8 GEMM here (CUDA: compute capability 9.0+)")
    saved = 0
    for block in model.layers:
        for name in PROJECTIONS:
            layer = getattr(block, name)
            if isinstance(layer, Fp8Linear):
                continue
            new = Fp8Linear.from_linear(layer)
            saved += _bytes(layer) - _bytes(new)
            setattr(block, name, new)
            del layer
    model.release_static()
    return saved
