"""Weights gathered where they are used (FSDP / ZeRO-3), for any model.

:func:`gathered_at_use` traces ``fn(whole_weights, *args)`` once (``jax.make_jaxpr``) and
evaluates it equation by equation while each device holds only its shard of the split weights.
A weight leaf, and whatever is computed from weights alone (a cast to bfloat16, a transpose),
stays a recipe until an equation combines it with activations (values computed from ``args``);
that equation runs as one ``jax.custom_vjp`` operation, which gathers its weights once the
activations exist and again, in the backward pass, once the cotangent exists, reduce-scattering
their gradients there (a data dependence, ``_tied``). So no gather is scheduled before the
operation that needs it, whole weights are held only around it, and no whole-model gradient is
formed: what FSDP implementations do per module, found from the program instead of the model.

Nested ``jit`` calls are evaluated inline; any other higher-order equation that reads weights
(``jax.checkpoint``-ed layers, ``lax.scan`` over stacked layers, custom derivatives) is one
operation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

__all__ = ["gathered_at_use"]

PyTree = Any
_INLINE = ("jit", "pjit", "closed_call", "core_call")
_LINEAR = ("add", "sub", "add_any")
"""Primitives whose derivative does not read the activations (nothing of them is saved)."""


class _Recipe:
    """A value computed from weights alone: ``make(whole)`` with ``whole`` the gathered
    weight leaves by index; ``deps`` the indices it reads."""

    __slots__ = ("deps", "make")

    def __init__(self, deps: frozenset[int], make: Callable[[dict[int, Any]], Any]) -> None:
        self.deps, self.make = deps, make


def _bind(eqn: Any, values: Sequence[Any]) -> list[Any]:
    """``eqn``'s primitive applied to ``values`` (as ``jax.core.eval_jaxpr`` does)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*values, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _tied(shards: list[Any], tie: Any) -> list[Any]:
    """``shards`` made to wait for ``tie`` (the activations, or the cotangent) by a data
    dependence XLA cannot remove (an ``optimization_barrier`` is expanded before XLA:CPU
    schedules): ``shard + (e != e)`` for one element ``e`` of ``tie`` as a float, ``+ 0``
    unless ``e`` is NaN (then the result is NaN anyway). XLA does not fold it for integer
    activations either (token ids), so an embedding table's gather is not hoisted out of the
    micro-batch loop (a whole table per device)."""
    leaves = [x for x in jax.tree.leaves(tie)
              if hasattr(x, "dtype") and jnp.size(x) > 0
              and (jnp.issubdtype(x.dtype, jnp.floating)
                   or jnp.issubdtype(x.dtype, jnp.integer))]
    if not leaves:
        return shards
    floats = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)]
    first = (floats or leaves)[0]
    e = jax.lax.slice(first, (0,) * first.ndim, (1,) * first.ndim).reshape(())
    e = e.astype(jnp.float32) if not floats else e
    nan = e != e
    return [s + nan.astype(s.dtype) if jnp.issubdtype(s.dtype, jnp.floating) else s
            for s in shards]


def _lookup_cotangent(eqn: Any, table: Any, indices: Any, ct: Any) -> Any:
    """The cotangent of ``table`` in ``gather(table, indices)``: ``ct`` scatter-added into
    zeros tied to it. (JAX's own transpose makes zeros that XLA:CPU scheduled at the start of
    the micro-step: a whole table per device held through every other layer's backward
    pass.)"""
    dn = eqn.params["dimension_numbers"]
    (zeros,) = _tied([jnp.zeros(jnp.shape(table), jnp.result_type(ct))], ct)
    return jax.lax.scatter_add(
        zeros, indices, ct,
        jax.lax.ScatterDimensionNumbers(
            update_window_dims=dn.offset_dims, inserted_window_dims=dn.collapsed_slice_dims,
            scatter_dims_to_operand_dims=dn.start_index_map,
            operand_batching_dims=dn.operand_batching_dims,
            scatter_indices_batching_dims=dn.start_indices_batching_dims),
        indices_are_sorted=eqn.params["indices_are_sorted"],
        unique_indices=eqn.params["unique_indices"], mode=eqn.params["mode"])


def gathered_at_use(fn: Callable[..., Any], weights: Sequence[Any], args: tuple, *,
                    gather: Sequence[Callable[[Any], Any] | None],
                    scatter: Sequence[Callable[[Any], Any] | None]) -> Any:
    """``fn(whole, *args)`` where ``whole[i] = gather[i](weights[i])`` is formed only where
    an equation uses it (see the module docstring).

    Args:
      fn: ``fn(whole_weights_list, *args) -> outputs`` (any pytree).
      weights: the weight leaves as this device holds them (shards).
      args: the other arguments (activations, state), a tuple of pytrees.
      gather: per weight leaf, the function making the whole leaf from its shard (e.g. an
        all-gather inside ``shard_map``), or ``None`` for a leaf used as it is.
      scatter: per gathered leaf, the function making the shard's gradient from the whole
        leaf's (a reduce-scatter), or ``None`` for a leaf not differentiated (frozen).

    Returns:
      ``fn``'s outputs, differentiable with respect to ``weights`` and ``args``.
    """
    weights, gather, scatter = list(weights), list(gather), list(scatter)
    whole_spec = [jax.eval_shape(gather[i], weights[i]) if gather[i] is not None
                  else jax.ShapeDtypeStruct(jnp.shape(weights[i]), jnp.result_type(weights[i]))
                  for i in range(len(weights))]
    arg_leaves, arg_tree = jax.tree.flatten(args)
    n = len(weights)

    def flat_fn(*flat: Any) -> Any:
        return fn(list(flat[:n]), *jax.tree.unflatten(arg_tree, list(flat[n:])))

    specs = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in arg_leaves]
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*whole_spec, *specs)
    out_tree = jax.tree.structure(out_shape)

    def gather_tied(deps: Sequence[int], shards: list[Any], tie: Any) -> list[Any]:
        return [gather[d](s) for d, s in zip(deps, _tied(list(shards), tie), strict=True)]

    def materialize(eqn: Any, ins: list[Any], literal: list[bool],
                    active: list[bool]) -> list[Any]:
        deps = sorted(set().union(*(x.deps for x in ins if isinstance(x, _Recipe))))
        # Literals (Python scalars in the jaxpr) stay constants of the operation.
        act_pos = [i for i, x in enumerate(ins)
                   if not isinstance(x, _Recipe) and not literal[i]]
        acts = [ins[i] for i in act_pos]
        # Tied to the activations (values computed from ``args``), not to constants.
        ties = [k for k, i in enumerate(act_pos) if active[i]] or list(range(len(acts)))
        linear = eqn.primitive.name in _LINEAR
        act_specs = [(jnp.shape(a), jnp.result_type(a)) for a in acts]

        def run(whole_list: list[Any], acts: list[Any]) -> list[Any]:
            whole = dict(zip(deps, whole_list, strict=True))
            values = [x.make(whole) if isinstance(x, _Recipe) else x for x in ins]
            for i, a in zip(act_pos, acts, strict=True):
                values[i] = a
            return _bind(eqn, values)

        @jax.custom_vjp
        def op(shards: list[Any], acts: list[Any]) -> list[Any]:
            return run(gather_tied(deps, shards, [acts[k] for k in ties]), acts)

        def fwd(shards: list[Any], acts: list[Any]) -> tuple[list[Any], Any]:
            return op(shards, acts), (shards, [] if linear else acts)

        trained = [k for k, d in enumerate(deps) if scatter[d] is not None]
        float_acts = any(jnp.issubdtype(dtype, jnp.inexact) for _, dtype in act_specs)
        # A lookup (an embedding's rows by token ids): its weight gradient is a scatter-add
        # into zeros that _lookup_grads ties to the cotangent.
        lookup = (eqn.primitive.name == "gather" and bool(trained) and not float_acts
                  and isinstance(ins[0], _Recipe) and act_pos == [1])

        def bwd(res: Any, ct: list[Any]) -> tuple[Any, Any]:
            shards, saved = res
            no_grads = [np.zeros(shape, jax.dtypes.float0) for shape, _ in act_specs]
            if not trained and not float_acts:
                # Frozen weights read with integer activations (an embedding lookup): no
                # gradient to compute, nothing to gather again.
                return [None] * len(deps), no_grads
            acts_now = ([jnp.zeros(shape, dtype) for shape, dtype in act_specs] if linear
                        else saved)
            whole = gather_tied(deps, shards, ct)

            def with_trained(part: list[Any]) -> list[Any]:
                # Differentiated only with respect to trained weights: frozen ones are
                # constants here (no gradient of the size of a frozen weight is formed).
                full = list(whole)
                for k, w in zip(trained, part, strict=True):
                    full[k] = w
                return full

            part = [whole[k] for k in trained]
            if lookup:  # the table's cotangent, then carried back to the weights
                def table(part: list[Any]) -> Any:
                    return ins[0].make(dict(zip(deps, with_trained(part), strict=True)))

                value = table(part)
                d_table = _lookup_cotangent(eqn, value, saved[0], ct[0])
                _, vjp = jax.vjp(table, part)
                (d_trained,), d_acts = vjp(d_table.astype(jnp.result_type(value))), no_grads
            else:
                _, vjp = jax.vjp(lambda p, a: run(with_trained(p), a), part, acts_now)
                d_trained, d_acts = vjp(ct)
            d_shards: list[Any] = [None] * len(deps)
            for k, g in zip(trained, d_trained, strict=True):
                d_shards[k] = scatter[deps[k]](g)
            return d_shards, d_acts

        op.defvjp(fwd, bwd)
        return op([weights[d] for d in deps], acts)

    def evaluate(jaxpr: Any, consts: Sequence[Any], invals: Sequence[Any],
                 active: Sequence[bool], top: bool = False) -> tuple[list[Any], list[bool]]:
        env: dict[Any, Any] = {}
        live: dict[Any, bool] = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, jcore.Literal) else env[v]

        def is_active(v: Any) -> bool:
            return False if isinstance(v, jcore.Literal) else live[v]

        for v, x in zip(jaxpr.constvars, consts, strict=True):
            env[v], live[v] = x, False
        for v, x, a in zip(jaxpr.invars, invals, active, strict=True):
            env[v], live[v] = x, a
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            acts = [is_active(v) for v in eqn.invars]
            recipes = [isinstance(x, _Recipe) for x in ins]
            if not any(recipes):
                outs, out_active = _bind(eqn, ins), [any(acts)] * len(eqn.outvars)
            elif eqn.primitive.name in _INLINE and "jaxpr" in eqn.params:
                inner = eqn.params["jaxpr"]
                inner_jaxpr = getattr(inner, "jaxpr", inner)
                outs, out_active = evaluate(inner_jaxpr, getattr(inner, "consts", ()), ins,
                                            acts)
            elif not any(a for a, r in zip(acts, recipes, strict=True) if not r):
                # Weights (and constants) only: still a recipe, formed where it is used.
                deps = frozenset().union(*(x.deps for x in ins if isinstance(x, _Recipe)))

                def make(whole: dict[int, Any], eqn: Any = eqn, ins: list = ins) -> list:
                    return _bind(eqn, [x.make(whole) if isinstance(x, _Recipe) else x
                                       for x in ins])

                outs = [_Recipe(deps, lambda whole, make=make, k=k: make(whole)[k])
                        for k in range(len(eqn.outvars))]
                out_active = [False] * len(eqn.outvars)
            else:
                outs = materialize(eqn, ins,
                                   [isinstance(v, jcore.Literal) for v in eqn.invars], acts)
                out_active = [True] * len(eqn.outvars)
            for v, x, a in zip(eqn.outvars, outs, out_active, strict=True):
                if not isinstance(v, jcore.DropVar):
                    env[v], live[v] = x, a
        results = []
        for v in jaxpr.outvars:
            x = read(v)
            if top and isinstance(x, _Recipe):  # an output of weights alone: gathered whole
                deps = sorted(x.deps)
                x = x.make(dict(zip(deps, gather_tied(deps, [weights[d] for d in deps], None),
                                    strict=True)))
            results.append(x)
        return results, [is_active(v) for v in jaxpr.outvars]

    start = [weights[i] if gather[i] is None else _Recipe(frozenset([i]),
                                                          lambda whole, i=i: whole[i])
             for i in range(n)]
    outs, _ = evaluate(closed.jaxpr, closed.consts, [*start, *arg_leaves],
                       [True] * (n + len(arg_leaves)), top=True)
    return jax.tree.unflatten(out_tree, outs)
