"""Distinct rows: a forward computes each distinct particle prefix once.

SMC-SD's particles are often the same sequence: resampling copies particles, and on
low-entropy text independent drafts from identical particles pick the same tokens. A row
whose history and new token equal another row's has the same keys, values and logits, so a
forward needs to compute only the distinct ones and hand every row its logits. The
decoders do not change: each particle still gets its own logits row and draws its own token.

:class:`RowHistories` keeps each row's generated tokens as a node of a prefix tree (a trie
of token ids rooted at the prompt): rows on one node hold identical histories. Prefill puts
every row on the root; :meth:`RowHistories.reorder` (resampling) copies a row's node;
:meth:`RowHistories.truncate` (speculative rollback) walks nodes back up; and
:meth:`RowHistories.plan` walks the rows of a forward of ``tokens [R, T]`` down the tree and
groups the (row, position) pairs that reach the same node: each group is one distinct row of
the forward (:class:`RowPlan`). A backend that computes a group once and gives its keys and
values to every member keeps the invariant the plan relies on: rows on the same node hold
the same KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowPlan:
    """How a forward of ``tokens [R, T]`` maps onto its ``U <= R * T`` distinct rows.

    Attributes:
        rows, width: ``R`` and ``T``.
        tokens: ``[U]`` token id of each distinct row, ordered by (first member, position):
            every row meets its positions in increasing order, and the set of rows sharing
            its token only shrinks from one position to the next (the order llama.cpp
            requires of a batch whose tokens belong to several sequences).
        positions: ``[U]`` position in the block, ``0 .. T-1``.
        members: ``[U]`` the rows (ascending) holding this token at this position.
        outputs: ``[U]`` whether its logits are returned (every position, or only the last
            one with ``last_only``).
        expand: int64 ``[R * T]``: the distinct row of each (row, position), row-major;
            ``None`` when every row is distinct (the distinct rows are then in row-major
            order already).
        representative: int64 ``[U]``: the flat row-major index of each distinct row's
            first member (``None`` with ``expand``).
        out_expand: int64 ``[R * T']`` (``T' = 1`` with ``last_only``): for each returned
            (row, position), row-major, its index among the distinct rows with outputs;
            ``None`` with ``expand``.
        nodes: the rows' trie nodes after the forward (applied by
            :meth:`RowHistories.commit`).
    """

    rows: int
    width: int
    tokens: list[int]
    positions: list[int]
    members: list[list[int]]
    outputs: list[bool]
    expand: torch.Tensor | None
    representative: torch.Tensor | None
    out_expand: torch.Tensor | None
    nodes: list[int] | None

    @property
    def distinct(self) -> int:
        """``U``, the rows the forward computes."""
        return len(self.tokens)

    @property
    def shared(self) -> bool:
        """Whether some rows share a distinct row (``U < R * T``)."""
        return self.expand is not None

    def expand_logits(self, logits: torch.Tensor, last_only: bool) -> torch.Tensor:
        """Every row's logits ``[R, T', V]`` from the distinct rows' ``[U_out, V]`` (a view
        when nothing is shared, a gathered copy otherwise)."""
        t_out = 1 if last_only else self.width
        if self.out_expand is not None:
            logits = logits.index_select(0, self.out_expand.to(logits.device))
        return logits.view(self.rows, t_out, logits.shape[-1])


def every_row_plan(tokens: list[list[int]], last_only: bool) -> RowPlan:
    """The plan that computes every (row, position): the behaviour without sharing."""
    r, t = len(tokens), len(tokens[0])
    flat = [tok for row in tokens for tok in row]
    return RowPlan(
        rows=r,
        width=t,
        tokens=flat,
        positions=[j for _ in range(r) for j in range(t)],
        members=[[i] for i in range(r) for _ in range(t)],
        outputs=[not last_only or j == t - 1 for _ in range(r) for j in range(t)],
        expand=None,
        representative=None,
        out_expand=None,
        nodes=None,
    )


class RowHistories:
    """Which rows of a cache hold the same generated tokens (see the module notes).

    Args:
        rows: the cache's particle rows ``R``.
        shared: plan forwards over distinct rows (``False``: every row is computed, as
            without this module; the tree is then not kept, nor for a single row, which
            has nothing to share).
    Attributes:
        computed, fed: rows computed and (row, position) pairs fed so far, over the cache's
            life (``computed / fed`` is the distinct fraction a request reports).
    """

    def __init__(self, rows: int, shared: bool = True) -> None:
        self.shared = shared and rows > 1
        self.node = [0] * rows  # every row on the root (the prompt)
        self._parent = [-1]
        self._children: dict[tuple[int, int], int] = {}
        self.computed = 0
        self.fed = 0

    def _child(self, node: int, token: int) -> int:
        key = (node, token)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = len(self._parent)
            self._parent.append(node)
        return child

    def plan(self, tokens: list[list[int]], last_only: bool) -> RowPlan:
        """The distinct rows of a forward of ``tokens`` (``R`` lists of ``T`` ids)."""
        if not self.shared:
            return every_row_plan(tokens, last_only)
        r, t = len(tokens), len(tokens[0])
        nodes = list(self.node)
        slot: dict[int, int] = {}  # trie node -> distinct row
        order: list[tuple[int, int, int]] = []  # (first member, position, token)
        members: list[list[int]] = []
        grid = [0] * (r * t)  # distinct row (creation order) of each (row, position)
        for i in range(r):
            for j in range(t):
                nodes[i] = self._child(nodes[i], tokens[i][j])
                u = slot.get(nodes[i])
                if u is None:
                    u = slot[nodes[i]] = len(order)
                    order.append((i, j, tokens[i][j]))
                    members.append([])
                members[u].append(i)
                grid[i * t + j] = u
        # creation order is already (first member, position): row i creates its own
        # distinct rows in increasing position, after every row before it
        outputs = [not last_only or j == t - 1 for (_, j, _) in order]
        plan = RowPlan(
            rows=r,
            width=t,
            tokens=[tok for (_, _, tok) in order],
            positions=[j for (_, j, _) in order],
            members=members,
            outputs=outputs,
            expand=None,
            representative=None,
            out_expand=None,
            nodes=nodes,
        )
        if len(order) < r * t:
            plan.expand = torch.tensor(grid, dtype=torch.long)
            plan.representative = torch.tensor([i * t + j for (i, j, _) in order])
            out_index, k = [], 0
            for want in outputs:
                out_index.append(k if want else -1)
                k += want
            cols = range(t - 1, t) if last_only else range(t)
            plan.out_expand = torch.tensor(
                [out_index[grid[i * t + j]] for i in range(r) for j in cols], dtype=torch.long
            )
        return plan

    def commit(self, plan: RowPlan) -> None:
        """The forward of ``plan`` ran: the rows advance to their new nodes."""
        self.computed += plan.distinct
        self.fed += plan.rows * plan.width
        if plan.nodes is not None:
            self.node = plan.nodes

    def reorder(self, ancestors: list[int] | torch.Tensor) -> None:
        """Row ``i`` becomes a copy of row ``ancestors[i]`` (resampling); ``ancestors`` a list
        or an int64 tensor, read back (on a GPU, a wait for the device) only where rows are
        shared."""
        if self.shared:
            anc = ancestors.tolist() if isinstance(ancestors, torch.Tensor) else ancestors
            self.node = [self.node[int(a)] for a in anc]

    def truncate(self, drop: int) -> None:
        """Every row loses its last ``drop`` tokens (speculative rollback)."""
        if not self.shared:
            return
        for _ in range(drop):
            self.node = [self._parent[n] for n in self.node]

    def groups(self) -> list[list[int]]:
        """The rows grouped by identical history (groups in order of their first row)."""
        by_node: dict[int, list[int]] = {}
        for i, n in enumerate(self.node):
            by_node.setdefault(n, []).append(i)
        return list(by_node.values())
