"""Running a decoder's round as one function of device tensors: called, or captured as a CUDA
graph and replayed.

A round (:class:`~smcspec.decoding.program.Round`) is ``fn(inputs) -> outputs``: dicts of
tensors, no host read inside (the decoders draw its random numbers beforehand, so no
generator runs inside either). :func:`run_round` runs it in one of two ways
(:attr:`Transformer.round_mode <smcspec.backends.torch.transformer.Transformer.round_mode>`):

* ``eager``: ``fn`` is called under :class:`HostReadGuard`, which raises
  :class:`HostReadError` at the first host read of a tensor's value (``bool(t)``,
  ``t.item()``, ``t.tolist()`` ...) or operation whose output shape depends on the values
  (``nonzero``, indexing or ``index_put_`` with a boolean mask ...): the CPU check that a
  round can be captured.
* ``graphs``: the first time a key is seen, ``fn`` runs once on a side stream (warm-up:
  cuBLAS handles, the allocator), then is captured with :class:`torch.cuda.CUDAGraph` into
  the model's graph memory pool, on inputs copied to static buffers; every round with that
  key copies its inputs into those buffers and replays the graph (PyTorch's "whole network
  capture" recipe, ``torch.cuda.graphs`` documentation). The graph is kept with the static
  cache it belongs to (:attr:`StaticKVCache.graphs
  <smcspec.backends.torch.static_cache.StaticKVCache.graphs>`), so the next request that
  takes the cache replays it. Graphs share one pool, so their outputs are cloned before
  the next replay can overwrite them.

A key must name everything the captured work depends on besides the inputs' values: shapes,
the attention windows, the constants the function closes over (temperatures, alpha, the
vocabulary size) and every cache it touches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as _dispatch_mode_stack

aten = torch.ops.aten

RoundFn = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]

HOST_READS = frozenset(
    {
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "__complex__",
        "item",
        "tolist",
        "numpy",
        "cpu",
    }
)
"""Tensor methods that hand device values to Python or copy them to the host (caught by
name: on a CPU tensor most of them reach no aten operation)."""

_MASKED = (
    aten.index,
    aten.index_put,
    aten.index_put_,
    aten._index_put_impl_,
    aten._unsafe_index_put,
)
"""aten operations whose output shape (``index``) or work (the ``index_put`` family: the
indices a mask selects) depends on a boolean or uint8 index's values (``IndexingUtils.h:
expandTensors`` turns each mask into ``nonzero``'s indices)."""


def data_dependent(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """Whether the aten operation ``func(*args, **kwargs)`` needs device values on the host:
    a CUDA graph cannot contain it, and on CUDA it waits for the device. These are the
    operations PyTorch itself tags as such (``torch.Tag.data_dependent_output``: ``item``,
    ``equal``, ``allclose`` ...; ``torch.Tag.dynamic_output_shape``: ``nonzero``,
    ``masked_select``, ``unique``, ``bincount`` ...; the tags ``FakeTensor`` and
    ``torch.compile`` refuse them by), read as ``FakeTensor`` reads them
    (``torch/_subclasses/fake_impls.py``): ``index`` only with a mask, ``repeat_interleave``
    only without ``output_size``; and the ``index_put`` family with a mask, which no tag
    marks. (With a Python number through one mask, ``x[mask] = 0.0``, CUDA takes a
    ``masked_fill_`` instead; it is counted all the same: write ``masked_fill_``.)"""
    if func.overloadpacket in _MASKED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
        )
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    tags = func.tags
    return torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags


class HostReadError(RuntimeError):
    """A round read a device value on the host: it could not be captured as a CUDA graph."""


class HostReadGuard(TorchFunctionMode):
    """Raises :class:`HostReadError` at the first host read while active; with
    ``strict=False`` records each one and lets it run (what a piece of code reads back:
    tests, ``benchmarks/round_host_work.py``).

    A host read is a :data:`HOST_READS` method (seen by this torch-function mode, by name),
    indexing with a boolean tensor, read or written (``x[mask]``, ``x[mask] = v``: recorded
    as ``__getitem__`` / ``__setitem__``), or any aten operation :func:`data_dependent`
    calls one, however it is reached (``x.index_put_((mask,), v)``, ``torch.where(mask)``,
    ``torch.unique``...: seen by a torch-dispatch mode entered with this one, and recorded
    by its name, ``index_put_``, ``nonzero``, ``_unique2``). A read is recorded once: the
    aten operations inside a recorded method are not recorded again.

    ``reads``: the operations seen (only the first when raising).
    """

    def __init__(self, strict: bool = True) -> None:
        super().__init__()
        self.strict = strict
        self.reads: list[str] = []
        self._inside = 0  # recorded methods running: their aten operations are theirs
        self._aten = _AtenReads(self)

    def __enter__(self) -> HostReadGuard:
        super().__enter__()
        try:
            self._aten.__enter__()
        except BaseException:
            super().__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._aten.__exit__(*exc)
        finally:
            super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        if name in HOST_READS or (name in ("__getitem__", "__setitem__") and _bool_index(args)):
            self.hit(name)
            self._inside += 1
            try:
                return func(*args, **kwargs)
            finally:
                self._inside -= 1
        return func(*args, **kwargs)

    def hit(self, name: str) -> None:
        """One host read, ``name``: raise (strict), or record it."""
        self.record(name)
        if self.strict:
            raise HostReadError(f"a round read a device value on the host ({name})")

    def record(self, name: str) -> None:
        """Note one host read (``name``: the operation)."""
        self.reads.append(name)


class _AtenReads(TorchDispatchMode):
    """The aten half of a :class:`HostReadGuard`: :func:`data_dependent` operations."""

    def __init__(self, guard: HostReadGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.guard._inside and data_dependent(func, args, kwargs):
            self.guard.hit(func.overloadpacket.__name__)
        return func(*args, **kwargs)


def compiled_region(fn: Callable) -> Callable:
    """``fn`` (a ``torch.compile(fullgraph=True)`` function) called with the aten half of any
    active :class:`HostReadGuard` set aside: Dynamo refuses to trace under a Python dispatch
    mode, and a function compiled whole cannot read the host anyway (a host read is a graph
    break, which ``fullgraph`` turns into an error), so nothing the guard would catch is
    missed. The torch-function half stays active around the call."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not any(isinstance(m, _AtenReads) for m in _dispatch_mode_stack()):
            return fn(*args, **kwargs)
        with _disable_current_modes():
            return fn(*args, **kwargs)

    return call


def _bool_index(args: tuple) -> bool:
    idx = args[1] if len(args) > 1 else None
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class RoundGraphs(dict):
    """The rounds kept with a static cache or a bank of them: ``key ->``
    :class:`CapturedRound` (mode ``graphs``), and ``checked``, the keys whose round has run
    uncaptured under the :class:`HostReadGuard` (mode ``eager``). An uncaptured round is
    guarded the first time its key runs, as a graph is captured once a key and replayed
    after: a key names everything its round's operations depend on but device values
    (which only a host read, caught at that first run, could bring in), so the later runs
    of a key run the same operations. :meth:`clear` forgets both."""

    def __init__(self) -> None:
        super().__init__()
        self.checked: set[tuple] = set()

    def clear(self) -> None:
        super().clear()
        self.checked.clear()


@dataclass
class CapturedRound:
    """One captured round: its graph, the static input buffers it reads, its outputs."""

    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    replays: int = 0


def run_round(
    mode: str,
    graphs: dict[tuple, CapturedRound],
    key: tuple,
    fn: RoundFn,
    inputs: dict[str, torch.Tensor],
    pool_owner: object,
    guard_once: bool = True,
) -> dict[str, torch.Tensor]:
    """Run the round ``fn`` on ``inputs`` as ``mode`` says (``eager`` or ``graphs``).

    Args:
        graphs: where the captured rounds are kept (a static cache's ``graphs``); a
            :class:`RoundGraphs` also remembers which keys ran guarded in mode ``eager``
            (a plain dict: every eager run is guarded).
        guard_once: in mode ``eager``, guard a key's first run only (with a
            :class:`RoundGraphs`); False guards every run (rounds on compiled kernels:
            Dynamo keys its compiled code on the torch-function modes active, so a round
            run guarded and then unguarded would compile twice).
        key: names the round's shapes and constants (module notes); the inputs must have
            the same shapes and dtypes every time a key is used.
        pool_owner: the model whose ``graph_pool`` the captures share (made here).
    Returns:
        The outputs (clones, owned by the caller).
    Raises:
        HostReadError: ``eager`` and ``fn`` read a device value on the host.
        ValueError: an unknown mode.
    """
    if mode == "eager":
        checked = getattr(graphs, "checked", None) if guard_once else None
        if checked is not None and key in checked:
            return fn(inputs)  # as a replay runs what its capture ran: checked once a key
        with HostReadGuard():
            out = fn(inputs)
        if checked is not None:
            checked.add(key)
        return out
    if mode != "graphs":
        raise ValueError(f"a round runs 'eager' or as 'graphs', not {mode!r}")
    entry = graphs.get(key)
    if entry is None:
        entry = capture(fn, inputs, pool_owner)
        graphs[key] = entry
    for name, t in inputs.items():
        entry.inputs[name].copy_(t)
    entry.graph.replay()
    entry.replays += 1
    return {name: t.clone() for name, t in entry.outputs.items()}


def capture(fn: RoundFn, inputs: dict[str, torch.Tensor], pool_owner: object) -> CapturedRound:
    """Warm ``fn`` up once on a side stream, then capture it on static copies of ``inputs``.

    The warm-up runs the round for real on the inputs (its writes to the caches are the
    ones the replay makes again); what it returns is dropped."""
    static = {name: t.clone() for name, t in inputs.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(static)
    torch.cuda.current_stream().wait_stream(side)
    if getattr(pool_owner, "graph_pool", None) is None:
        pool_owner.graph_pool = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread's CUDA calls (a server's) do not void this capture
    with torch.cuda.graph(graph, pool=pool_owner.graph_pool, capture_error_mode="thread_local"):
        outputs = fn(static)
    return CapturedRound(graph, static, outputs)
