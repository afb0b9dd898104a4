"""The contract between framework adapters and the planner: a pure, donating train step."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import numpy as np

from ..devices._profiles import itemsize
from ._micro_batches import UnevenBatches

PyTree = Any


class StepMetrics(NamedTuple):
    """What one accumulated optimizer step reports."""

    loss: jax.Array
    """Mean per-item loss over the whole effective batch."""
    count: jax.Array
    """Number of valid items (tokens or examples) in the effective batch."""
    grad_sq_norm: jax.Array
    """|mean gradient|^2 of the effective batch."""
    micro_grad_sq_norm: jax.Array
    """Mean over micro-batches of |micro-batch mean gradient|^2."""
    finite: jax.Array | bool = True
    """Whether the step's loss and gradients were finite; computed on the device, so reading
    it costs no extra host sync."""
    logs: Mapping[str, jax.Array] | None = None
    """The framework's own logs of the step (Keras: the loss tracker's and compiled metrics'
    results, as ``model.fit`` logs them), else ``None``. Part of the compiled step, so the
    step planning measures is the step training runs."""


@dataclass(frozen=True)
class TrainProgram:
    """A train step that the planner can lower, compile and measure without any weights.

    ``step(state, batches, *frozen_args) -> (new_state, StepMetrics)`` is pure and jittable;
    ``state`` is donated, ``frozen_args`` (weights the step reads but never changes) are not,
    so a failed step cannot delete them. ``batches`` has the structure of ``example_spec``
    with two leading axes ``[accum_steps, micro_batch]``. ``parts`` names the abstract
    sub-trees of ``state`` so a memory estimate can be itemized (``"trainable"``,
    ``"frozen"``, ``"optimizer"``, ...).
    """

    step: Callable[..., tuple[PyTree, StepMetrics]]
    abstract_state: PyTree
    example_spec: PyTree
    parts: Mapping[str, PyTree]
    trainable: PyTree
    frozen_args: tuple[PyTree, ...] = ()
    lowering_context: Callable[[], AbstractContextManager[Any]] = field(
        default=contextlib.nullcontext
    )
    description: str = ""
    mesh: Any = None
    """The one-axis data-parallel ``jax.sharding.Mesh`` the step runs on, or ``None`` (one
    device). With a mesh, ``step`` takes global batches ``[accum_steps, dp * micro, ...]``."""
    data_parallel_step: Callable[[Any], Callable[..., tuple[PyTree, StepMetrics]]] | None = None
    """``data_parallel_step(mesh)`` builds the step for a data-parallel mesh, or the
    single-device step for ``None`` (set by the Flax and Keras adapters)."""
    sharded_step: Callable[[Any], tuple[Callable[..., Any], PyTree]] | None = None
    """``sharded_step(layout)`` builds the step for a :class:`~autoaccum.planning.StateLayout`
    (a strategy other than ``"replicated"``) and returns it with the state's shardings
    (structured as ``abstract_state``); ``None``: replicated data parallelism only."""
    strategy: str = "replicated"
    """The sharding strategy of the step on its mesh."""
    partitioner: str = "autoaccum"
    """Who partitions the step over its mesh: autoaccum's ``shard_map`` step or XLA alone
    (see :data:`~autoaccum.internal.PARTITIONERS`)."""
    state_shardings: PyTree = None
    """Shardings of ``abstract_state`` for a sharded strategy (``None``: copied on every
    device of the mesh)."""
    layout: Any = None
    """The :class:`~autoaccum.planning.StateLayout` of a sharded strategy, else ``None``."""
    own_specs: tuple[Any, ...] | None = None
    """The model's own sharding: for each leaf of ``trainable`` (``jax.tree.leaves`` order)
    the ``PartitionSpec`` it arrived split by, or ``None``; kept under every strategy."""
    loop_relowers: bool = False
    """Whether the training loop lowers this very program again (both adapters' loops do):
    a compiled probe that can run here is then kept for it."""
    placement: Any = None
    """The user's own layout of the state (a ``Placement``: a Keras ``ModelParallel`` layout
    map, arrays that arrive sharded), or ``None``. With one, ``step`` is the single-device
    step on global batches, compiled with the placement's shardings as input and output
    shardings (XLA partitions it); ``mesh`` is then ``None``."""
    placed_step: Callable[[Any], Any] | None = None
    """For a placed program: builds ``step`` for another ``Placement`` (the same layout over
    other devices, see :meth:`placed_onto`); ``None`` where the step does not depend on it."""
    deviceless_fallback: set[str] = field(default_factory=set, init=False, compare=False,
                                          repr=False)
    """Fingerprints of the deviceless targets for which a compile of this step needed
    ``DEVICELESS_FALLBACK``: its other micro-batches for that GPU use it at once."""

    @property
    def data_parallel(self) -> int:
        """Number of data-parallel devices (1 without a mesh): the batch is split over them."""
        if self.placement is not None:
            return self.placement.data_parallel
        return 1 if self.mesh is None else int(self.mesh.size)

    @property
    def device_mesh(self) -> Any:
        """The mesh of every device the step runs on (a placement's or the data-parallel
        one), or ``None`` for one device: the per-device budget is that of its devices."""
        return self.placement.mesh if self.placement is not None else self.mesh

    def on_mesh(self, mesh: Any, strategy: str = "replicated", *,
                partitioner: str = "autoaccum") -> TrainProgram:
        """This program data-parallel over ``mesh`` (``None``: single device) with the sharding
        ``strategy`` (ignored on one device), partitioned by ``partitioner``
        (:data:`~autoaccum.internal.PARTITIONERS`).

        Example:
          >>> import jax, jax.numpy as jnp
          >>> program = TrainProgram(step=None, abstract_state=(), example_spec={}, parts={},
          ...                        trainable=())
          >>> program.on_mesh(None).data_parallel
          1
        """
        from ._strategies import (
            fixed_on_mesh,
            state_layout,
            validate_partitioner,
            validate_strategy,
        )

        validate_strategy(strategy, allow_auto=False)
        validate_partitioner(partitioner)
        if mesh is not None and mesh.size == 1:
            mesh = None
        if mesh is None:
            strategy, partitioner = "replicated", "autoaccum"
        if mesh is None and self.mesh is None:
            return self
        if mesh is self.mesh and (strategy, partitioner) == (self.strategy, self.partitioner):
            return self
        if self.placement is not None:
            raise ValueError(
                f"This model's variables are laid out by {self.placement.source or 'the user'} "
                f"over a mesh {dict(self.placement.mesh.shape)}; autoaccum keeps that layout and "
                f"splits batches over its data axis ({self.placement.data_axis!r}), so it "
                "cannot also replicate the model over another data-parallel mesh. Leave "
                "data_parallel at its default ('auto') with the framework's distribution set "
                "(Keras: keras.distribution.set_distribution), or pass data_parallel=1. "
                f"Received: data_parallel={mesh.size if mesh is not None else 1}")
        if self.data_parallel_step is None:
            raise ValueError(
                "This TrainProgram has no data-parallel step; build it with flax_program or "
                f"keras_program. Received: a program for {self.description or 'a custom step'}"
            )
        own = self.own_specs is not None and any(s is not None for s in self.own_specs)
        if strategy == "replicated" and not own and partitioner == "autoaccum":
            return dataclasses.replace(self, step=self.data_parallel_step(mesh), mesh=mesh,
                                       strategy=strategy, state_shardings=None, layout=None,
                                       partitioner=partitioner)
        if self.sharded_step is None:
            raise ValueError(
                f"This program ({self.description or 'a custom step'}) runs replicated data "
                "parallelism only; autoaccum cannot shard its state yet. Pass "
                f"strategy='replicated'. Received: strategy={strategy!r}")
        layout = state_layout(strategy, mesh, params=self.parts.get("trainable"),
                              optimizer=self.parts.get("optimizer"),
                              fixed=fixed_on_mesh(self.own_specs, mesh,
                                                  self.parts.get("trainable")),
                              frozen=self.frozen_args, partitioner=partitioner)
        step, shardings = self.sharded_step(layout)
        return dataclasses.replace(self, step=step, mesh=mesh, strategy=strategy,
                                   state_shardings=shardings, layout=layout,
                                   partitioner=partitioner)

    def placed_onto(self, devices: Any) -> TrainProgram:
        """This placed program with its layout kept over other ``devices`` (as many as its
        mesh has), for a dry run for a slice that is not here.

        Example:
          >>> import jax
          >>> program = TrainProgram(step=None, abstract_state=(), parts={}, trainable=(),
          ...                        example_spec={})
          >>> program.placed_onto(jax.devices()) is program  # not placed: nothing to move
          True
        """
        if self.placement is None:
            return self
        placement = self.placement.onto(devices)
        step = self.step if self.placed_step is None else self.placed_step(placement)
        state = placement.abstract(self.abstract_state, placement.state)
        frozen = placement.abstract(tuple(self.frozen_args), placement.frozen)
        return dataclasses.replace(self, step=step, placement=placement, abstract_state=state,
                                   frozen_args=frozen)

    def batch_spec(self, micro_batch: int, accum_steps: int, sharding: Any = None, *,
                   last: int | None = None, last_sharding: Any = None) -> PyTree:
        """:func:`abstract_batches` of this program's ``example_spec``.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> program = TrainProgram(step=None, abstract_state=(), parts={}, trainable=(),
          ...                        example_spec={"x": jax.ShapeDtypeStruct((7,), jnp.int32)})
          >>> program.batch_spec(4, 2)["x"].shape
          (2, 4, 7)
        """
        return abstract_batches(self.example_spec, micro_batch, accum_steps, sharding,
                                last=last, last_sharding=last_sharding)


def abstract_batches(example_spec: PyTree, micro_batch: int, accum_steps: int,
                     sharding: Any = None, *, last: int | None = None,
                     last_sharding: Any = None) -> PyTree:
    """Abstract batches of ``example_spec`` of shape ``[accum_steps, micro_batch, ...]`` for
    lowering; with ``last``, an :class:`~autoaccum.planning.UnevenBatches` of ``[accum_steps -
    1, micro_batch, ...]`` and ``[last, ...]`` (``last_sharding``, default ``sharding``).

    ``micro_batch`` and ``last`` are global ones (``dp * per-device``) for a mesh."""
    if last is None or last == micro_batch or accum_steps < 2:
        return stacked(example_spec, accum_steps, micro_batch, sharding=sharding)
    return UnevenBatches(
        full=stacked(example_spec, accum_steps - 1, micro_batch, sharding=sharding),
        last=stacked(example_spec, last,
                     sharding=last_sharding if last_sharding is not None else sharding),
    )


def stacked(example_spec: PyTree, *leading: int, sharding: Any = None) -> PyTree:
    """``example_spec`` (one example's shapes) with ``leading`` axes in front, laid out by
    ``sharding``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> stacked({"x": jax.ShapeDtypeStruct((7,), jnp.int32)}, 2, 5)["x"].shape
      (2, 5, 7)
    """
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct((*leading, *s.shape), held_dtype(s.dtype),
                                                       sharding=sharding), example_spec)


def tree_bytes(tree: PyTree) -> int:
    """Total bytes of the array leaves (real or abstract) of ``tree``.

    Typed PRNG keys (``jax.random.key``, as ``nnx.Rngs`` holds them) count their key data."""
    return int(sum(int(np.prod(local_shape(leaf))) * itemsize(leaf.dtype)
                   for leaf in jax.tree.leaves(tree)
                   if hasattr(leaf, "shape") and hasattr(leaf, "dtype")))


def local_shape(leaf: Any) -> tuple[int, ...]:
    """The shape one device holds of ``leaf``: its shard's for an abstract leaf with a
    sharding, else the whole shape."""
    shape = tuple(leaf.shape)
    sharding = getattr(leaf, "sharding", None) if isinstance(leaf, jax.ShapeDtypeStruct) else None
    if sharding is not None and hasattr(sharding, "shard_shape"):
        return tuple(sharding.shard_shape(shape))
    return shape


def abstract(tree: PyTree) -> PyTree:
    """``jax.ShapeDtypeStruct`` leaves for every array-like leaf of ``tree``, each dtype as
    JAX holds it (numpy's default int64 labels are int32 without ``jax_enable_x64``, as
    they arrive in the step; asked for as int64, JAX would warn on every plan).

    Example:
      >>> abstract({"y": np.zeros(4, np.int64)})["y"].dtype == jax.numpy.zeros(1, int).dtype
      True
    """
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), held_dtype(
        x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)), tree)


def held_dtype(dtype: Any) -> Any:
    """``dtype`` as a JAX array holds it: int64 and float64 are int32 and float32 without
    ``jax_enable_x64``; extended dtypes (typed PRNG keys) as they are.

    Example:
      >>> held_dtype(np.int64) == jax.numpy.zeros(1, int).dtype
      True
    """
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return dtype
    return jax.dtypes.canonicalize_dtype(dtype)
