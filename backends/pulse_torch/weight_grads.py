"""A split backward that walks the graph once: B keeps the gradients W starts from.

Zero-bubble schedules run a chunk's backward as B (input gradients, sent upstream
now) and W (weight gradients, later). Asking autograd for the parameters' gradients
from the chunk's outputs again in W walks every activation gradient twice. Instead,
as ``torch.distributed.pipelining._backward`` does (ported here onto public autograd
APIs, so a change of that private module cannot break a run)::

    graph        outputs ──▶ ... ──▶ intermediate node ──▶ ... ──▶ inputs
                                        ▲
                                     params
    B            autograd.grad(outputs -> inputs); a pre-hook on every intermediate
                 node (where a parameter's path joins the inputs' path) keeps the
                 gradient flowing into it
    W            autograd.grad(those nodes' gradient edges -> params) from the kept
                 gradients: the weight halves, nothing above the intermediates again

A chunk where an output does not depend on the inputs (a shared input made from the
data alone) has parameter gradients no intermediate carries: ``input_half`` then
returns no ``WeightHalf`` and the caller walks from the outputs (correct, not cheaper).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node


@dataclass
class _Group:
    """Parameters whose paths join the inputs' path at ``intermediates``; ``grads`` kept by B."""

    params: set[Node]
    intermediates: list[Node]
    grads: list[tuple[Tensor | None, ...] | None] = field(default_factory=list)


@dataclass
class WeightHalf:
    """What W needs: the groups, and each parameter by its gradient accumulator node."""

    groups: list[_Group]
    params: dict[Node, Tensor]


def node_of(t: Tensor) -> Node | None:
    """A tensor's grad_fn, or a leaf's gradient accumulator (created through a view)."""
    if t.requires_grad and t.grad_fn is None:
        return t.view_as(t).grad_fn.next_functions[0][0]
    return t.grad_fn


def _reverse_edges(roots: list[Node]) -> dict[Node, list[Node]]:
    """Node -> the nodes that consume its output (towards the outputs)."""
    edges: dict[Node, list[Node]] = collections.defaultdict(list)
    queue = collections.deque(dict.fromkeys(n for n in roots if n is not None))
    seen = set(queue)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            edges[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return edges


def _closure(roots: list[Node], stop: set[Node], edges: dict[Node, list[Node]]) -> tuple[set[Node], set[Node]]:
    """Nodes reached from ``roots`` towards the outputs, and the ``stop`` nodes met (not crossed)."""
    closure = set(n for n in roots if n is not None)
    met: set[Node] = set()
    queue = collections.deque(closure)
    while queue:
        for parent in edges[queue.popleft()]:
            if parent in closure:
                continue
            if parent in stop:
                met.add(parent)
                continue
            closure.add(parent)
            queue.append(parent)
    return closure, met


def _groups(input_side: set[Node], params: list[Node], edges: dict[Node, list[Node]]) -> list[_Group]:
    """Parameters grouped by the intermediates where their paths join the inputs' path
    (``input_side``: every node reached from the inputs towards the outputs)."""
    by_node: dict[Node, _Group] = {}
    for param in params:
        _, met = _closure([param], input_side, edges)
        group = _Group({param}, list(met))
        for node in met:
            if node in by_node and by_node[node] is not group:
                other = by_node[node]
                other.params |= group.params
                other.intermediates = list(dict.fromkeys(other.intermediates + group.intermediates))
                group = other
            by_node[node] = group
    unique = {id(g): g for g in by_node.values()}
    return list(unique.values())


def input_half(outputs: Sequence[Tensor], grads: Sequence[Tensor], inputs: Sequence[Tensor],
               params: Sequence[Tensor]) -> tuple[tuple[Tensor | None, ...], WeightHalf | None]:
    """Gradients of ``inputs`` (B), and what W needs (None: W must walk from the outputs)."""
    edges = _reverse_edges([node_of(t) for t in outputs])
    input_nodes = [node_of(t) for t in inputs]
    input_side, _ = _closure(input_nodes, set(), edges)
    if any(node_of(t) not in input_side for t in outputs):  # a gradient no intermediate would carry
        got = torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)
        return got, None
    by_node = {node_of(p): p for p in params}
    groups = _groups(input_side, list(by_node), edges)
    handles = []
    for group in groups:
        group.grads = [None] * len(group.intermediates)
        for i, node in enumerate(group.intermediates):
            def keep(grad_outputs, group=group, i=i):
                group.grads[i] = grad_outputs
            handles.append(node.register_prehook(keep))
    try:
        got = torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return got, WeightHalf(groups, by_node)


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def weight_half(half: WeightHalf, accumulated: Callable[[Tensor], None] | None = None) -> None:
    """Accumulate the parameters' gradients into ``.grad`` from the gradients B kept, the groups
    of the chunk's last layers first (as a whole backward makes them: the data-parallel buckets
    go in that order, ``pulse.grad_buckets``), telling ``accumulated`` of each parameter done.

    Each group's walk is the last over its part of the graph, so it frees what it passes
    (``retain_graph=False``, as ``torch.distributed.pipelining``'s W): the activations go back
    to the allocator while the gradients are made, which then reuse their pages. Kept alive to
    the end of W, they made the step's first W fault in fresh pages for every gradient."""
    waiting = collections.Counter(_storage(g) for group in half.groups for g in _kept(group))
    given: set[int] = set()
    for group in reversed(half.groups):
        roots, root_grads = [], []
        for node, kept in zip(group.intermediates, group.grads):
            for i, g in enumerate(kept or ()):
                if g is not None:
                    roots.append(GradientEdge(node, i))
                    root_grads.append(g)
        own = {_storage(g) for g in _kept(group)}
        waiting.subtract(_storage(g) for g in _kept(group))
        if not roots:
            continue
        # an intermediate below another would receive its gradient twice: pin each to what B kept
        handles = [node.register_prehook(lambda _, kept=kept: kept)
                   for node, kept in zip(group.intermediates, group.grads)
                   if kept is not None and len(group.intermediates) > 1]
        try:
            nodes = list(group.params)
            got = torch.autograd.grad(roots, [GradientEdge(n, 0) for n in nodes], root_grads,
                                      allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        group.grads, roots, root_grads = [], [], []
        # a gradient that is a kept one passed through is copied: it may also be an input's gradient
        # B returned, or a later group's root (a kept gradient no longer held cannot be matched)
        accumulate([half.params[n] for n in nodes], got, given | own | {k for k, n in waiting.items() if n > 0})
        given.update(_storage(p.grad) for p in (half.params[n] for n in nodes) if p.grad is not None)
        for node in nodes if accumulated is not None else ():
            accumulated(half.params[node])
    half.groups.clear()


def _kept(group: _Group) -> list[Tensor]:
    return [g for kept in group.grads for g in (kept or ()) if g is not None]


def accumulate(params: Sequence[Tensor], grads: Sequence[Tensor | None], taken: set[int] | None = None) -> None:
    """Add ``grads`` into the parameters' ``.grad``.

    A fresh gradient becomes ``.grad`` itself, as autograd's own accumulation does and
    ``torch.distributed.pipelining``'s W: a copy of each cost a quarter to a third of W at
    SD v2 size (a 49M-parameter block's 190 MB written twice). Copied only where it shares
    memory with a tensor in ``taken`` (gradients B kept) or one already given to a parameter
    (an identity-like backward passes its input through), so no in-place update reaches two
    tensors; or where its layout or dtype is not the parameter's (the optimizer's fused kernels
    expect the parameter's)."""
    taken = set() if taken is None else taken
    with torch.no_grad():
        for p, g in zip(params, grads):
            if g is None:
                continue
            if p.grad is not None:
                p.grad.add_(g)
                continue
            g = g.detach()
            if _storage(g) in taken or g.stride() != p.stride() or g.dtype != p.dtype:
                g = g.clone(memory_format=torch.preserve_format)
            taken.add(_storage(g))
            p.grad = g
