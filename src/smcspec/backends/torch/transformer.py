"""A Llama-family decoder-only transformer written for batched particle decoding.

Shapes: ``R`` rows (particles), ``T`` new tokens per row, ``P`` prompt length, ``S`` filled
suffix length, ``H``/``Hkv`` query/key-value heads, ``D`` head dim, ``V`` vocabulary.

Two forwards, both over a :class:`~smcspec.backends.torch.kv_cache.ParticleKVCache`:

* :meth:`Transformer.prefill`: the prompt ``[1, P]`` -> shared prefix KV.
* :meth:`Transformer.decode`: ``[R, T]`` new tokens per row at positions ``P + S + t``;
  every row attends to the shared prompt KV (broadcast, not copied) and to its own suffix.

Distinct rows (:mod:`smcspec.backends.shared_rows`): the projections, MLPs and output layer
run only over the ``U <= R * T`` distinct (history, token) rows of a forward; attention
expands their queries, keys and values to the full ``[R, T]`` grid (an index, a copy of
``U`` small vectors), writes every row's keys and values into its own suffix, and keeps the
output of each distinct row's first member. A row therefore goes through the same
arithmetic whether or not it is shared, except that the matrix products see ``U`` rows
instead of ``R * T``.

Numerics follow the Hugging Face ``transformers`` Llama/Qwen2 implementations (RMSNorm in
float32, rotate-half RoPE, SwiGLU); q/k/v and gate/up projections are fused for speed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smcspec.backends.pool import Lease, ResourcePool
from smcspec.backends.shared_rows import RowPlan
from smcspec.backends.torch.architecture import ModelConfig
from smcspec.backends.torch.flex import particle_mask
from smcspec.backends.torch.graphs import RoundFn, run_round
from smcspec.backends.torch.kernels import (
    EAGER,
    KERNEL_MODES,
    LayerKernels,
    auto_failed,
    auto_kernels,
    is_compile_error,
    kernel_set,
)
from smcspec.backends.torch.kv_cache import ParticleKVCache
from smcspec.backends.torch.static_cache import SlotBank, StaticKVCache, StaticSlots, bucket
from smcspec.backends.torch.static_view import LayerView, StaticView

ROUND_MODES = ("auto", "steps", "eager", "graphs")
"""How the decoders' rounds run on a :class:`Transformer` (:attr:`Transformer.rounds`):
``steps`` one forward request at a time with the sampling on the host between them (distinct
rows shared; every CPU path), ``eager`` a whole round as one function of device tensors on a
static cache, called directly (what the CPU tests compare with ``steps``), ``graphs`` that
function captured once per shape as a CUDA graph and replayed, ``auto`` graphs on CUDA and
steps elsewhere."""


def default_kv_budget(device: torch.device) -> int:
    """Bytes of KV storage the torch backend's requests may reserve together: 90% of the
    free memory of a CUDA device, half of the available memory (``/proc/meminfo``) on the
    CPU (8 GiB where that cannot be read). Read when the pool is first used, after the
    weights are loaded, once for the two models of a pair on one device
    (:meth:`Transformer.share_pool`); the rest is the activations', the CUDA graphs' and
    PyTorch's own, none of which the pool counts."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * 0.9)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return 8 << 30


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies ``[D/2]`` float32 (Su et al. 2021), with Llama 3.1 scaling."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling
    if rs:  # "llama3" frequency-dependent scaling, as in Meta's reference code
        factor = rs["factor"]
        low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_ctx = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_ctx / low, old_ctx / high
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.to(torch.float32)


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019), computed in float32 like ``transformers``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = EAGER  # see Transformer.use_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


def linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """``layer(x)`` computed as ``(W @ x^T)^T`` over ``x`` flattened to ``[M, in]``.

    Same result as ``F.linear``; on CPU BLAS (MKL, fp32) this form is 1.2-4x faster on the
    large projections for the 2-20 rows of speculative and particle decoding, and within
    a fraction of a millisecond on the small ones (docs/benchmarks/linear-layout.md).
    Any other layer (:class:`~smcspec.backends.torch.fp8.Fp8Linear`) runs its own forward.
    """
    if not isinstance(layer, nn.Linear):
        return layer(x)
    flat = x.reshape(-1, x.shape[-1])
    out = (layer.weight @ flat.t()).t()
    if layer.bias is not None:
        out = out + layer.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


@dataclass
class Segment:
    """One request's rows inside a batched forward.

    ``rows x tokens`` new tokens appended to ``cache`` at suffix index ``start`` (``None``:
    a prefill of ``tokens`` prompt tokens into the shared prefix, from prompt position
    ``prefill_at``: a chunk of a prompt run in pieces), computed as the ``distinct`` rows
    ``offset .. offset + distinct`` of the batch; ``plan`` maps them onto the ``[rows,
    tokens]`` grid (``None`` for a prefill). Unless the segment is ``shared`` its rows are
    every (row, position), row-major.
    """

    cache: ParticleKVCache
    rows: int
    tokens: int
    start: int | None
    offset: int
    last_only: bool
    plan: RowPlan | None = None
    prefill_at: int = 0

    @property
    def shared(self) -> bool:
        return self.plan is not None and self.plan.shared

    @property
    def distinct(self) -> int:
        return self.plan.distinct if self.plan is not None else self.rows * self.tokens


class Block(nn.Module):
    """One pre-norm decoder layer: GQA attention + SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = self.h * self.d, self.hkv * self.d
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.qkv_bias)
        self.o = nn.Linear(q, cfg.hidden_size, bias=cfg.o_bias)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.scale = 1.0 / math.sqrt(self.d)
        self.kernels = EAGER  # see Transformer.use_kernels

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[M, H, D]``, keys and values ``[M, Hkv, D]`` of ``x`` ``[M, hidden]``,
        RoPE applied (``cos``/``sin``: ``[M, D]``)."""
        m = x.shape[0]
        qkv = linear(self.attn_norm(x), self.qkv)
        qk, v = qkv.split([(self.h + self.hkv) * self.d, self.hkv * self.d], dim=-1)
        # queries and keys rotated together: the same elementwise arithmetic, half the kernels
        qk = self.kernels.rotate(
            qk.reshape(m, self.h + self.hkv, self.d), cos[:, None, :], sin[:, None, :]
        )
        q, k = qk.split([self.h, self.hkv], dim=1)
        return q, k, v.view(m, self.hkv, self.d)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream after the attention output ``attn`` ``[M, H*D]`` and the MLP."""
        x = x + linear(attn, self.o)
        gate, up = linear(self.mlp_norm(x), self.gate_up).chunk(2, dim=-1)
        return x + linear(self.kernels.silu_mul(gate, up), self.down)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[Segment]
    ) -> torch.Tensor:
        """``x``: ``[M, hidden]``, all segments' distinct rows flattened; ``cos``/``sin``:
        ``[M, D]``."""
        q, k, v = self.project(x, cos, sin)
        outs = []
        for seg in segments:  # attention is per request (own cache); everything else batched
            sl = slice(seg.offset, seg.offset + seg.distinct)
            qs, ks, vs = q[sl], k[sl], v[sl]
            if seg.shared:  # distinct rows -> every (row, position) of the grid
                grid = seg.plan.expand
                qs, ks, vs = qs[grid], ks[grid], vs[grid]
            qs = qs.view(seg.rows, seg.tokens, self.h, self.d).transpose(1, 2)
            ks = ks.view(seg.rows, seg.tokens, self.hkv, self.d).transpose(1, 2)
            vs = vs.view(seg.rows, seg.tokens, self.hkv, self.d).transpose(1, 2)
            if seg.start is None:
                out = self._prefill_attention(qs, ks, vs, seg.cache, seg.prefill_at)
            else:
                out = self._decode_attention(qs, ks, vs, seg.cache, seg.start)
            out = out.reshape(seg.rows * seg.tokens, self.h * self.d)
            if seg.shared:  # back to the distinct rows: each one's first member
                out = out[seg.plan.representative]
            outs.append(out)
        return self.finish(x, outs[0] if len(outs) == 1 else torch.cat(outs))

    def forward_static(self, x: torch.Tensor, view: StaticView) -> torch.Tensor:
        """One layer over every row of a static forward (:meth:`Transformer.decode_static`,
        :meth:`Transformer.decode_bank`): ``x`` ``[R*T, hidden]``, rows row-major; no host
        read, fixed shapes. Runs :attr:`kernels`' whole-layer function where it has one."""
        layer = view.layer(self.layer)
        if self.kernels.layer is not None:
            return self.kernels.layer(self, x, layer)
        return self.forward_layer(x, layer)

    def forward_layer(self, x: torch.Tensor, view: LayerView) -> torch.Tensor:
        """:meth:`forward_static` on this layer's :class:`LayerView`: projections, RoPE, the
        cache write, attention (flex where ``view.flex`` is set), output and MLP."""
        q, k, v = self.project(x, view.cos, view.sin)
        t = view.tokens
        r = x.shape[0] // t
        k = k.view(r, t, self.hkv, self.d).transpose(1, 2)
        v = v.view(r, t, self.hkv, self.d).transpose(1, 2)
        view.write(k, v)
        if view.flex is not None:  # one kernel: each slot's n*T queries over prompt + rows
            qf = q.view(view.pk.shape[0], -1, self.h, self.d).transpose(1, 2)
            if self.kernels.layer is not None:  # the RoPE kernel writes this layout (and
                qf = qf.clone(memory_format=torch.contiguous_format)  # PyTorch 2.13's C++
                # flex template misreads a query that is a view of another buffer)
            out = self.kernels.flex(qf, view.pk, view.pv, view.sk, view.sv, view.flex, self.scale)
            return self.finish(x, out.transpose(1, 2).reshape(r * t, self.h * self.d))
        q = q.view(r, t, self.h, self.d).transpose(1, 2)
        qg = q.reshape(r, self.hkv, (self.h // self.hkv) * t, self.d)
        masks = view.mask_prefix, view.mask_suffix
        out = self.kernels.attend(qg, view.pk, view.pv, view.sk, view.sv, *masks, self.scale)
        out = out.view(r, self.hkv, self.h // self.hkv, t, self.d).permute(0, 3, 1, 2, 4)
        return self.finish(x, out.reshape(r * t, self.h * self.d))

    def prefill_static(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: StaticKVCache
    ) -> torch.Tensor:
        """One layer of a static prefill (:meth:`Transformer.prefill` on a captured cache):
        ``x`` ``[Pw, hidden]`` the padded prompt; its keys and values fill the first ``Pw``
        positions of the prompt storage (the padding's are masked by every later forward)."""
        q, k, v = self.project(x, cos, sin)
        pw = x.shape[0]
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, Pw, D]
        cache.prefix_store_k[self.layer, :, :, :pw] = k
        cache.prefix_store_v[self.layer, :, :, :pw] = v
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.finish(x, out[0].transpose(0, 1).reshape(pw, self.h * self.d))

    def _prefill_attention(self, q, k, v, cache: ParticleKVCache, at: int = 0) -> torch.Tensor:
        """Prompt positions ``at .. at + T - 1``: their keys and values stored in the shared
        prefix, causal attention over it (a later chunk of a prompt run in pieces also sees
        every earlier prompt position, stored by the chunks before)."""
        r, _, t, _ = q.shape
        cache.prefix_k[self.layer, :, :, at : at + t] = k
        cache.prefix_v[self.layer, :, :, at : at + t] = v
        if at == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            keys = cache.prefix_k[self.layer, :, :, : at + t]
            values = cache.prefix_v[self.layer, :, :, : at + t]
            kpos = torch.arange(at + t, device=q.device)
            seen = kpos <= torch.arange(at, at + t, device=q.device)[:, None]  # [T, at + T]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=seen, enable_gqa=True)
        return out.transpose(1, 2).reshape(r, t, self.h * self.d)

    def _decode_attention(self, q, k, v, cache: ParticleKVCache, start: int) -> torch.Tensor:
        r, _, t, d = q.shape
        g = self.h // self.hkv
        end = start + t
        cache.suffix_k[self.layer, :, :, start:end] = k
        cache.suffix_v[self.layer, :, :, start:end] = v
        pk, pv = cache.prefix_k[self.layer], cache.prefix_v[self.layer]  # [1, Hkv, P, D]
        sk = cache.suffix_k[self.layer, :, :, :end]  # [R, Hkv, S, D]
        sv = cache.suffix_v[self.layer, :, :, :end]
        qg = q.reshape(r, self.hkv, g * t, d)  # head h = kv * g + j; rows ordered (j, t)
        # causal mask over the new block: query t sees suffix positions <= start + t
        qpos = torch.arange(t, device=q.device).repeat(g) + start  # [g*T]
        spos = torch.arange(end, device=q.device)
        mask = spos[None, :] > qpos[:, None]  # [g*T, S]
        out = self.kernels.attend(qg, pk[0], pv[0], sk, sv, None, mask, self.scale)
        return out.view(r, self.hkv, g, t, d).permute(0, 3, 1, 2, 4).reshape(r, t, self.h * d)


class Transformer(nn.Module):
    """Decoder-only transformer (Llama family) for particle decoding.

    Args:
        cfg: architecture.
    Weights are loaded with :func:`smcspec.backends.torch.weights.load_weights`.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._rope_len = 0
        self._cos = self._sin = None
        self.kv_budget_bytes: int | None = None  # None: default_kv_budget(device)
        self._pool: ResourcePool | None = None
        self._pool_is_default = False  # made with default_kv_budget (shared with peers)
        self._pool_peers: list[Transformer] = []  # see share_pool
        self.rounds = "auto"  # see ROUND_MODES
        self.static_slots = StaticSlots(self._make_static, lambda: self.pool, self._kv_bytes)
        self.graph_pool = None  # the CUDA graphs' memory pool, made at the first capture
        self.kernels = EAGER  # what the layers run now: kernel_mode resolved (_sync_kernels)
        self.kernel_mode: str | LayerKernels = "auto"  # see use_kernels
        self.joined_calls = self.joined_rounds = 0  # run_joined: calls, rounds they ran

    def use_kernels(self, kernels: LayerKernels | str) -> None:
        """Run every layer's norms, RoPE, gating and attention with ``kernels``: a name of
        :data:`~smcspec.backends.torch.kernels.KERNEL_MODES` (``eager``, ``compiled``,
        ``flex``, ``layer``, or ``auto``, the default: ``flex`` on CUDA, ``eager`` elsewhere,
        :func:`~smcspec.backends.torch.kernels.auto_kernels`) or a
        :class:`~smcspec.backends.torch.kernels.LayerKernels`. Captured rounds are kept per
        kernel set (:meth:`run_round`), so switching back and forth captures nothing again.
        Raises ValueError for an unknown name."""
        if isinstance(kernels, str) and kernels not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {KERNEL_MODES}, not {kernels!r}")
        self.kernel_mode = kernels
        self._sync_kernels()

    def _sync_kernels(self) -> LayerKernels:
        """Give every module the set :attr:`kernel_mode` names now (``auto`` depends on the
        device and on whether compiling failed); returns it."""
        mode = self.kernel_mode
        if isinstance(mode, LayerKernels):
            want = mode
        else:
            auto = mode == "auto"
            want = auto_kernels(self.device, self.cfg.head_dim) if auto else kernel_set(mode)
        if want is not self.kernels:
            for m in self.modules():
                if hasattr(m, "kernels"):
                    m.kernels = want
        return want

    def _keyed(self, key: tuple) -> tuple:
        """A round's graph key with the kernel set its layers run now (a graph replays the
        kernels it captured)."""
        kernels = self._sync_kernels()
        return (*key, kernels.name) if kernels.compiled else key

    def _falling_back(self, call: Callable[[], Any]) -> Any:
        """``call()``; where ``auto`` chose a compiled set and compiling it fails, once more
        with the written kernels (the failure logged, :func:`~smcspec.backends.torch.
        kernels.auto_failed`). The round's writes before the failure are the ones the second
        call makes again (same inputs, same positions)."""
        try:
            return call()
        except Exception as exc:
            if self.kernel_mode != "auto" or not self.kernels.compiled:
                raise
            if not is_compile_error(exc):
                raise
            auto_failed(exc)
            return call()

    @property
    def round_mode(self) -> str:
        """How rounds run now (:data:`ROUND_MODES`, ``auto`` resolved; ``graphs`` only on
        CUDA, ``eager`` in its place elsewhere)."""
        if self.rounds not in ROUND_MODES:
            raise ValueError(f"rounds must be one of {ROUND_MODES}, not {self.rounds!r}")
        cuda = self.device.type == "cuda"
        if self.rounds == "auto":
            return "graphs" if cuda else "steps"
        return "eager" if self.rounds == "graphs" and not cuda else self.rounds

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer (logits per position)."""
        return self.cfg.vocab_size

    @property
    def pool(self) -> ResourcePool:
        """The ``kv_bytes`` the requests of this model reserve (see :mod:`smcspec.backends.pool`;
        budget :attr:`kv_budget_bytes`, default :func:`default_kv_budget`), made when first
        used. A model with the default budget shares the default pool of a model it was
        paired with (:meth:`share_pool`) on the same device, if that one is made already."""
        if self._pool is None:
            if self.kv_budget_bytes:
                self._pool = ResourcePool("torch", {"kv_bytes": self.kv_budget_bytes})
                self._pool_is_default = False
                return self._pool
            shared = [
                p._pool
                for p in self._pool_peers
                if p._pool is not None and p._pool_is_default and p.device == self.device
            ]
            if shared:
                self._pool = shared[0]
            else:
                budget = default_kv_budget(self.device)
                self._pool = ResourcePool("torch", {"kv_bytes": budget})
            self._pool_is_default = True
        return self._pool

    def share_pool(self, other: Any) -> None:
        """Reserve from one pool with ``other`` (the other model of a pair) where both keep the
        default budget and sit on one device: two default pools would each lend 90% of the
        same free memory (:func:`default_kv_budget`). Decided when the pools are first used;
        a model that is not a :class:`Transformer` is ignored."""
        if isinstance(other, Transformer) and other is not self:
            self._pool_peers.append(other)
            other._pool_peers.append(self)

    def cache_need(self, rows: int, capacity: int, prompt_len: int) -> dict[str, int]:
        """Bytes of KV a cache of ``rows`` x ``capacity`` generated tokens after a
        ``prompt_len``-token prompt (stored once) allocates: K and V, every layer. Where
        rounds may run fused (:attr:`round_mode` not ``steps``) the request may take a static
        slot, whose capacity and prompt storage are rounded up to powers of two
        (:func:`~smcspec.backends.torch.static_cache.bucket`): those bytes, which also cover
        the ordinary cache it falls back to (:mod:`~smcspec.backends.torch.static_cache`)."""
        if self.round_mode != "steps":
            capacity, prompt_len = bucket(capacity), bucket(prompt_len)
        return {"kv_bytes": self._kv_bytes(rows, capacity, prompt_len)}

    def _kv_bytes(self, rows: int, capacity: int, prompt_len: int) -> int:
        c = self.cfg
        per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * self.dtype.itemsize
        return per_token * (prompt_len + rows * capacity)

    def new_cache(
        self,
        rows: int,
        capacity: int,
        lease: Lease | None = None,
        shared_rows: bool = True,
        static: bool = False,
        prompt_len: int = 0,
        slot: int | None = None,
    ) -> ParticleKVCache:
        """A cache for ``rows`` particles with room for ``capacity`` generated tokens each.

        ``lease``: the request's reservation from :attr:`pool` (an ordinary cache allocates
        its own tensors, freed with it; a static one gives the lease's share for its slot to
        the bank that pays for it, :meth:`StaticSlots.take`); without one nothing is
        reserved for an ordinary cache (a static slot's bank is still paid from the pool).
        ``shared_rows``: compute each distinct row of a forward once (the module notes).
        ``static``: a :class:`StaticKVCache` from :attr:`static_slots` for a prompt of up to
        ``prompt_len`` tokens (what graph-captured rounds need), where the round mode is not
        ``steps`` and a slot is free; otherwise an ordinary cache. ``slot``: the static slot
        to prefer (:meth:`StaticSlots.take`)."""
        if static and self.round_mode != "steps":
            held = self.static_slots.slots
            if held and held[0].suffix_k.device != self.device:  # the model moved (.to)
                self.release_static()
            cache = self.static_slots.take(rows, capacity, prompt_len, lease, slot)
            if cache is not None:
                return cache
        c = self.cfg
        return ParticleKVCache(
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            rows,
            capacity,
            self.dtype,
            self.device,
            shared_rows=shared_rows,
        )

    def run_round(
        self,
        cache: StaticKVCache,
        key: tuple,
        fn: RoundFn,
        inputs: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """Run a decoder's round ``fn(inputs)`` as :attr:`round_mode` says, its graph kept
        with ``cache`` under ``key`` (:func:`smcspec.backends.torch.graphs.run_round`), and
        under ``(*key, name)`` when the layers run a compiled kernel set ``name`` (a graph
        replays the kernels it captured; :meth:`_falling_back`)."""
        cache.rounds_run += 1

        def call() -> dict[str, torch.Tensor]:
            with torch.inference_mode():
                return run_round(
                    self.round_mode, cache.graphs, self._keyed(key), fn, inputs, self,
                    guard_once=not self.kernels.compiled,
                )  # fmt: skip

        return self._falling_back(call)

    def joinable(self, join: Any) -> tuple | None:
        """Where a round's :class:`~smcspec.decoding.program.Join` may run batched: the
        identities of its caches' banks, when every cache is static, all at one slot of
        banks of one size, and the rounds run fused; else None (it runs alone)."""
        banks = [getattr(c, "bank", None) for c in join.caches]
        if self.round_mode == "steps" or any(b is None for b in banks):
            return None
        if len({c.slot for c in join.caches}) > 1 or len({b.slots for b in banks}) > 1:
            return None
        return tuple(id(b) for b in banks)

    def run_joined(self, rounds: Sequence[tuple[Any, dict[str, torch.Tensor]]]) -> list:
        """Run the rounds of several requests as one call over every slot of their banks:
        ``rounds`` are ``(join, inputs)`` pairs (:class:`~smcspec.decoding.program.Join`,
        :attr:`~smcspec.decoding.program.Round.inputs`) with one key, whose caches
        :meth:`joinable` puts in the same banks. Their inputs are stacked per slot (zeros
        where no member is; ``keep`` marks the members), and the call is captured with the
        first bank under ``("joined", key, slots, suffix window, prompt windows, bank
        serials)``. Returns each round's outputs (its slot's row of each output). Raises
        ValueError for rounds that cannot join."""
        joins = [j for j, _ in rounds]
        places = {self.joinable(j) for j in joins}
        if len(places) > 1 or None in places or len({j.key for j in joins}) > 1:
            raise ValueError("joined rounds need one key and caches in the same banks")
        banks = tuple(c.bank for c in joins[0].caches)
        slots = [j.caches[0].slot for j in joins]
        by_slot = dict(zip(slots, (x for _, x in rounds), strict=True))
        stacked = {}
        for name, first in rounds[0][1].items():
            absent = torch.zeros_like(first)
            stacked[name] = torch.stack(
                [by_slot[b][name] if b in by_slot else absent for b in range(banks[0].slots)]
            )
        on = torch.ones((), dtype=torch.bool, device=self.device)  # no host-to-device copy
        off = torch.zeros_like(on)
        stacked["keep"] = torch.stack([on if b in by_slot else off for b in range(banks[0].slots)])
        span = max(j.suffix_window for j in joins)
        p_windows = tuple(max(j.caches[i].prompt_window for j in joins) for i in range(len(banks)))
        key = ("joined", joins[0].key, banks[0].slots, span, p_windows)
        key += tuple(b.serial for b in banks)
        fn = joins[0].fn
        for j in joins:
            j.caches[0].rounds_run += 1
        self.joined_calls += 1
        self.joined_rounds += len(joins)

        def call() -> dict[str, torch.Tensor]:
            with torch.inference_mode():
                return run_round(
                    self.round_mode, banks[0].graphs, self._keyed(key),
                    lambda x: fn(banks, x, span, p_windows), stacked, self,
                    guard_once=not self.kernels.compiled,
                )  # fmt: skip

        out = self._falling_back(call)
        return [{name: t[b] for name, t in out.items()} for b in slots]

    def release_static(self) -> None:
        """Drop the static caches kept for reuse and their CUDA graphs: their tensors go back
        to PyTorch's allocator and their bytes to :attr:`pool` now, or, for a bank a request
        still holds a cache of, when its last one is closed (caches in use stay valid)."""
        self.static_slots.release()
        self.graph_pool = None

    def _make_static(self, rows: int, capacity: int, prefix_capacity: int) -> SlotBank:
        c = self.cfg
        self._rope_table(prefix_capacity + capacity)  # a captured forward cannot grow it
        return SlotBank(
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            rows,
            capacity,
            prefix_capacity,
            self.dtype,
            self.device,
        )

    def _rope_table(self, need: int) -> None:
        """Make the cos/sin tables cover positions ``< need`` (float32 ``[n, D]``)."""
        if self._cos is None or need > self._rope_len or self._cos.device != self.device:
            n = max(need, 2 * self._rope_len, 256)  # grown, or moved by .to()
            t = torch.arange(n, device=self.device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq.to(self.device))
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos, self._sin = emb.cos(), emb.sin()
            self._rope_len = n

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._rope_table(int(positions.max()) + 1)
        return self._cos[positions].to(self.dtype), self._sin[positions].to(self.dtype)

    def _run(self, segments: list[Segment], tokens: list[torch.Tensor]) -> list[torch.Tensor]:
        """Forward of several segments, each computing its distinct rows ``tokens[i]`` (int64
        ``[U_i]``); the logits of each segment as ``[rows, tokens or 1, V]``."""
        self._sync_kernels()
        # a request's tokens may be on the CPU (distinct rows, built from lists) or the device
        flat = torch.cat([t.to(self.device) for t in tokens]) if len(tokens) > 1 else tokens[0]
        pos, picks = [], []
        for seg in segments:
            if not seg.shared:  # a prefill, or every row computed
                base = seg.prefill_at if seg.start is None else seg.cache.prompt_len + seg.start
                pos.append((torch.arange(seg.tokens) + base).repeat(seg.rows))
                rows = torch.arange(seg.rows) * seg.tokens + seg.offset
                if seg.last_only:
                    picks.append(rows + seg.tokens - 1)
                else:
                    picks.append((rows[:, None] + torch.arange(seg.tokens)).reshape(-1))
            else:
                base = seg.cache.prompt_len + seg.start
                pos.append(torch.tensor(seg.plan.positions) + base)
                picks.append(torch.tensor(seg.plan.outputs).nonzero()[:, 0] + seg.offset)
        cos, sin = self._rope((torch.cat(pos) if len(pos) > 1 else pos[0]).to(self.device))
        x = self.embed(flat.to(self.device))
        for layer in self.layers:
            x = layer(x, cos, sin, segments)
        # only the positions whose logits are wanted go through the (large) lm_head
        idx = (torch.cat(picks) if len(picks) > 1 else picks[0]).to(self.device)
        logits = linear(self.norm(x[idx]), self.lm_head).float()
        out, at = [], 0
        for seg, pick in zip(segments, picks, strict=True):
            part = logits[at : at + pick.numel()]
            at += pick.numel()
            if not seg.shared:
                out.append(part.view(seg.rows, 1 if seg.last_only else seg.tokens, -1))
            else:
                out.append(seg.plan.expand_logits(part, seg.last_only))
        return out

    @torch.inference_mode()
    def prefill(
        self,
        prompt: torch.Tensor,
        cache: ParticleKVCache,
        start: int = 0,
        end: int | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor | None:
        """Run the prompt and store its KV once in ``cache`` as the shared prefix (a static
        cache where rounds run fused: as a round of its own, a CUDA graph per padded prompt
        length, :meth:`_prefill_captured`), or one chunk of it.

        Args:
            prompt: int64 ``[P]`` token ids, ``P >= 1``.
            start, end: run prompt positions ``start .. end - 1`` only (default: all), a
                chunk of a prompt run in pieces, in order: the first chunk starts at 0, each
                later one where the one before ended (on a static cache such a prompt's
                chunks run eagerly, not as a captured round). The logits equal the whole
                prompt's up to float rounding (the same arithmetic in other groupings).
            all_logits: return the logits of every position of the chunk (eagerly, never as
                a captured round): what a prompt's log-probabilities need.
        Returns:
            float32 logits ``[V]`` of the next token after the prompt; None after a chunk
            that does not end the prompt; with ``all_logits`` ``[end - start, V]`` for
            every chunk (row ``i``: the next token after position ``start + i``).
        Raises:
            ValueError: a chunk out of range or out of order.
            ContextLengthError: a static cache too small for the prompt.
        """
        p = prompt.shape[-1]
        end = p if end is None else end
        if not 0 <= start < end <= p or (start > 0 and start != cache.prefilled):
            raise ValueError(
                f"prefill chunk [{start}, {end}) of a {p}-token prompt, after {cache.prefilled}"
            )
        if start == 0:
            cache.begin_prefill(p)
        flat = prompt.reshape(-1)
        whole = end - start == p and not all_logits
        if whole and isinstance(cache, StaticKVCache) and self.round_mode != "steps":
            logits = self._prefill_captured(flat, cache)
        else:
            seg = Segment(cache, 1, end - start, None, 0, not all_logits, prefill_at=start)
            logits = self._run([seg], [flat[start:end]])[0][0]
            logits = logits if all_logits else logits[-1]
        cache.prefilled = end
        return logits if end == p or all_logits else None

    def _prefill_captured(self, prompt: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """The prefill of a static cache as a round (a CUDA graph per padded prompt length,
        :meth:`run_round`): the prompt padded to ``cache.prompt_window`` tokens, causal
        attention (the prompt's rows never see the padding after them), the logits of its
        last token. float32 ``[V]``."""
        pw = cache.prompt_window
        padded = torch.zeros(pw, dtype=torch.long, device=self.device)
        padded[: prompt.numel()] = prompt.to(self.device)
        inputs = {"tokens": padded, "last": torch.full((), prompt.numel() - 1, device=self.device)}
        return self.run_round(cache, ("prefill", pw), self._static_prefill_fn(cache), inputs)[
            "logits"
        ]

    def _static_prefill_fn(self, cache: StaticKVCache):
        def fn(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            pw = x["tokens"].shape[0]
            cos = self._cos[:pw].to(self.dtype)
            sin = self._sin[:pw].to(self.dtype)
            h = self.embed(x["tokens"])
            for layer in self.layers:
                h = layer.prefill_static(h, cos, sin, cache)
            last = self.norm(h.index_select(0, x["last"].view(1)))
            return {"logits": linear(last, self.lm_head).float()[0]}

        return fn

    @torch.inference_mode()
    def decode(
        self, tokens: torch.Tensor, cache: ParticleKVCache, last_only: bool = False
    ) -> torch.Tensor:
        """Append ``tokens`` to every row of ``cache`` and return their next-token logits.

        Args:
            tokens: int64 ``[R, T]`` with ``R == cache.rows``.
            last_only: return only the logits after the last token.
        Returns:
            float32 logits ``[R, T, V]`` (``[R, 1, V]`` with ``last_only``).
        Raises:
            ContextLengthError: the cache has no room for ``T`` more tokens.
        """
        return self.decode_batch([(tokens, cache, last_only)])[0]

    @torch.inference_mode()
    def decode_batch(
        self, items: Sequence[tuple[torch.Tensor, ParticleKVCache, bool]]
    ) -> list[torch.Tensor]:
        """:meth:`decode` for several requests in one forward (each with its own cache).

        The projections and MLPs run once over all rows of all requests (this is what makes
        batching cheap: the weights are read once); attention runs per request over its own
        shared prompt KV and row suffixes. ``items``: ``(tokens [R_i, T_i], cache_i,
        last_only_i)``. Returns the logits of each item as :meth:`decode` would.
        Raises:
            ContextLengthError: a cache has no room (no cache is modified then).
        """
        segments, distinct, offset = [], [], 0
        for tokens, cache, _ in items:
            if tokens.shape[0] != cache.rows:
                raise ValueError(f"{tokens.shape[0]} token rows for a cache of {cache.rows} rows")
        starts = [cache.begin_step(t.shape[1]) for t, cache, _ in items]  # all-or-error
        for (tokens, cache, last_only), start in zip(items, starts, strict=True):
            r, t = tokens.shape
            plan = cache.histories.plan(tokens.tolist(), last_only)
            if plan.shared:  # the indices go to the device once, not once per layer
                plan.expand = plan.expand.to(self.device)
                plan.representative = plan.representative.to(self.device)
                plan.out_expand = plan.out_expand.to(self.device)
            seg = Segment(cache, r, t, start, offset, last_only, plan)
            segments.append(seg)
            distinct.append(torch.tensor(plan.tokens) if plan.shared else tokens.reshape(-1))
            offset += seg.distinct
        out = self._run(segments, distinct)
        for seg in segments:
            seg.cache.end_step()
            seg.cache.histories.commit(seg.plan)
        return out

    @torch.inference_mode()
    def decode_static(
        self,
        tokens: torch.Tensor,
        cache: StaticKVCache,
        start: torch.Tensor,
        suffix_window: int,
        last_only: bool = False,
    ) -> torch.Tensor:
        """:meth:`decode` for a graph-captured round: fixed shapes, no host read.

        Every row is computed (no distinct rows). The new tokens go to suffix positions
        ``start .. start + T - 1`` of every row; attention reads the prompt storage up to
        its bucketed prompt length and the suffix up to ``suffix_window``, with masks from
        the device scalars ``cache.prompt_len_t`` and ``start``. Neither the cache's host
        ``length`` nor its histories change: the caller accounts for what the round wrote.

        Args:
            tokens: int64 ``[R, T]`` on the model's device, ``R == cache.rows``.
            cache: a :class:`StaticKVCache` holding a prompt (prefilled).
            start: int64 0-dim device tensor, the suffix position of ``tokens[:, 0]``.
            suffix_window: suffix positions attended, ``>= start + T`` (the caller's
                bucket; positions ``>= start + T`` are masked), ``<= cache.capacity``.
            last_only: return only the logits after the last token.
        Returns:
            float32 logits ``[R, T, V]`` (``[R, 1, V]`` with ``last_only``).
        """
        t = tokens.shape[1]
        write_at = (start + torch.arange(t, device=tokens.device))[None]  # [1, T]
        stores = (cache.suffix_k, cache.suffix_v, cache.prefix_store_k, cache.prefix_store_v)
        lengths = cache.prompt_len_t.view(1)
        view = self._static_view(stores, lengths, write_at, suffix_window, cache.prompt_window)
        return self._static_logits(tokens, view, last_only)

    @torch.inference_mode()
    def decode_bank(
        self,
        tokens: torch.Tensor,
        bank: SlotBank,
        starts: torch.Tensor,
        keep: torch.Tensor,
        suffix_window: int,
        prompt_window: int,
        last_only: bool = False,
    ) -> torch.Tensor:
        """:meth:`decode_static` for every slot of ``bank`` at once (the rounds of several
        requests as one forward: each weight read once for all of them); no host read.

        Args:
            tokens: int64 ``[slots * rows, T]``, rows slot-major (slot ``b``'s rows first
                at ``b * rows``).
            starts: int64 ``[slots]``, the suffix position of each slot's first token.
            keep: bool ``[slots]``: False for a slot no round of this forward belongs to
                (its rows are computed on whatever they hold, and its stored keys and values
                written back unchanged).
            suffix_window, prompt_window: positions attended (``>= starts + T`` and ``>=``
                every kept slot's prompt length; powers of two within the bank's sizes).
            last_only: return only the logits after the last token.
        Returns:
            float32 logits ``[slots * rows, T, V]`` (``[slots * rows, 1, V]``).
        """
        write_at = starts[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
        stores = (bank.suffix_k, bank.suffix_v, bank.prefix_k, bank.prefix_v)
        view = self._static_view(
            stores, bank.prompt_len_t, write_at, suffix_window, prompt_window, keep
        )
        return self._static_logits(tokens, view, last_only)

    def _static_view(
        self,
        stores: tuple[torch.Tensor, ...],
        prompt_lens: torch.Tensor,
        write_at: torch.Tensor,
        suffix_window: int,
        prompt_window: int,
        keep: torch.Tensor | None = None,
    ) -> StaticView:
        """What the layers of a static forward read: ``stores`` the suffix and prompt
        storage (``suffix_k, suffix_v, prefix_k, prefix_v``) of ``B`` slots, their prompt
        lengths ``[B]`` and the suffix positions written ``[B, T]``; one slot without
        ``keep`` writes every row at the same positions (``index_copy_``), several
        scatter per slot. The masks are the written attention's or the flex attention's,
        whichever the layers' kernels run."""
        b, t = write_at.shape
        rows = stores[0].shape[1] // b
        n, dev = b * rows, write_at.device
        positions = prompt_lens[:, None] + write_at  # [B, T]; rows slot-major, then tokens
        cos = self._cos[positions].to(self.dtype)[:, None].expand(b, rows, t, -1).reshape(n * t, -1)
        sin = self._sin[positions].to(self.dtype)[:, None].expand(b, rows, t, -1).reshape(n * t, -1)
        hkv, d = self.cfg.num_kv_heads, self.cfg.head_dim
        per_slot = {}
        if b > 1 or keep is not None:
            at = write_at[:, None, None, :, None].expand(b, rows, hkv, t, d)
            per_slot["scatter_at"] = at.reshape(n, hkv, t, d)
            if keep is not None:
                per_slot["keep"] = keep[:, None].expand(b, rows).reshape(n, 1, 1, 1)
        else:
            per_slot["write_at"] = write_at[0]
        if self._sync_kernels().flex is not None:
            mask = particle_mask(prompt_lens, write_at, rows, prompt_window, suffix_window)
            masks = {"flex": mask}
        else:
            g = self.cfg.num_heads // hkv
            spos = torch.arange(suffix_window, device=dev)
            masks = {
                "mask_prefix": torch.arange(prompt_window, device=dev) >= prompt_lens[:, None],
                "mask_suffix": spos > write_at.repeat(1, g)[:, :, None],  # [B, g*T, Sw]
            }
        return StaticView(
            *stores,
            tokens=t,
            prefix_window=prompt_window,
            suffix_window=suffix_window,
            cos=cos,
            sin=sin,
            **masks,
            **per_slot,
        )

    def _static_logits(
        self, tokens: torch.Tensor, view: StaticView, last_only: bool
    ) -> torch.Tensor:
        r, t = tokens.shape
        x = self.embed(tokens.reshape(-1))
        for layer in self.layers:
            x = layer.forward_static(x, view)
        if last_only:
            x = x.view(r, t, -1)[:, -1]
        logits = linear(self.norm(x), self.lm_head).float()
        return logits.view(r, 1 if last_only else t, -1)
