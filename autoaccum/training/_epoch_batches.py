"""User data (a dict, tuple, NamedTuple or dataclass of numpy arrays, or one array, with a
leading example axis) to batches of shape ``[accum_steps, micro_batch, ...]``, and a stream's
batches re-cut into effective batches as they arrive (:class:`Rebatcher`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..planning._micro_batches import UnevenBatches, split_sizes
from ..planning._option_checks import received, type_name
from ..planning._train_program import held_dtype

PyTree = Any


def as_arrays(data: object, *, name: str = "data") -> PyTree:
    """``data`` validated, as a pytree of numpy arrays sharing a leading (example) axis.

    Accepts a mapping, tuple or list, ``NamedTuple`` or dataclass of array-likes, or one array.
    A ``NamedTuple`` or pytree dataclass (``flax.struct``) keeps its type, a plain dataclass
    becomes a dict of its fields (see :func:`batch_rebuilder`); ``None`` fields stay ``None``.

    Example:
      >>> tree = as_arrays({"x": [[1, 2], [3, 4]], "y": [0, 1]})
      >>> num_examples(tree)
      2
    """
    if (not isinstance(data, Mapping | tuple | list) and not hasattr(data, "shape")
            and not is_dataclass_instance(data)):
        raise ValueError(
            f"{name} must be a dict, tuple, NamedTuple or dataclass of numpy arrays (or one "
            "array) whose first axis is the example axis. Received: "
            f"{name} of type {type(data).__name__}"
        )
    tree = _to_numpy(tuple(data) if isinstance(data, list) else data, name=name)
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        raise ValueError(
            f"{name} is empty: give at least one array with a leading example axis. "
            f"Received: {received(name, data)}"
        )
    paths = _paths(tree)
    for path, array in zip(paths, leaves, strict=True):
        if array.ndim == 0:
            raise ValueError(
                f"Every array in {name} needs a leading example axis; {name}{path} is a scalar. "
                f"Add an axis (e.g. x[None]). Received: {name}{path} with shape ()"
            )
        if array.dtype == object:
            raise ValueError(
                f"{name}{path} is not a numeric array (dtype=object). Tokenize or pad it to a "
                "numeric array first."
            )
        if array.dtype.kind in "USV":
            raise ValueError(
                f"{name}{path} holds {'strings' if array.dtype.kind != 'V' else 'raw bytes'} "
                f"(dtype {array.dtype}); a Flax model trains on numbers. Tokenize or encode it "
                "to a numeric array first (e.g. token ids, np.int32). "
                f"Received: {name}{path} with dtype {array.dtype}"
            )
    lengths = {path: a.shape[0] for path, a in zip(paths, leaves, strict=True)}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{name}{p}: {n}" for p, n in lengths.items())
        raise ValueError(
            f"All arrays in {name} must have the same number of examples (leading axis) so that "
            f"example i means the same row everywhere. Received leading sizes: {shown}"
        )
    if next(iter(lengths.values())) == 0:
        raise ValueError(f"{name} is empty: it has 0 examples. Received: leading axis of size 0")
    return jax.tree.unflatten(treedef, leaves)  # (dict keys sorted, as JAX orders them)


def is_dataclass_instance(obj: object) -> bool:
    """Whether ``obj`` is a dataclass instance (not a dataclass type)."""
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _is_pytree_node(obj: object) -> bool:
    """Whether JAX flattens ``obj`` itself (a registered dataclass such as a ``flax.struct``
    one), rather than taking it for one leaf."""
    return not jax.tree_util.all_leaves([obj])


def batch_rebuilder(data: object) -> Callable[[Any], Any] | None:
    """For a plain ``dataclasses.dataclass`` batch (not a JAX pytree), the function that makes
    one from its fields (a dict), so a ``loss_fn`` receives the batch's own type; else ``None``.
    """
    if not is_dataclass_instance(data) or _is_pytree_node(data):
        return None
    cls = type(data)
    return lambda fields: cls(**fields)


def _to_numpy(obj: object, path: str = "", *, name: str = "data") -> PyTree:
    """Mappings, tuples (a ``NamedTuple`` keeps its type) and dataclasses are containers,
    ``None`` stays ``None``; anything else (lists included) is one array."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return {str(k): _to_numpy(v, f"{path}[{str(k)!r}]", name=name) for k, v in obj.items()}
    if isinstance(obj, tuple):
        items = [_to_numpy(v, f"{path}[{i}]", name=name) for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if is_dataclass_instance(obj):
        if _is_pytree_node(obj):  # a flax.struct dataclass: the same type, arrays inside
            return jax.tree_util.tree_map_with_path(
                lambda key, leaf: _to_numpy(leaf, path + jax.tree_util.keystr(key), name=name),
                obj)
        return {f.name: _to_numpy(getattr(obj, f.name), f"{path}.{f.name}", name=name)
                for f in dataclasses.fields(obj)}
    try:
        return np.asarray(obj)
    except ValueError as error:  # ragged nested lists
        raise ValueError(
            f"{name}{path} is ragged: its rows have different lengths, so it is not one array. "
            "Pad every row to the same length and pass a mask of the real items (the loss_fn "
            "counts only those), e.g. np.zeros((n, max_len)) filled row by row. "
            f"Received: {name}{path} = {_short(obj)} ({str(error).split('.')[0]})"
        ) from None


def _short(obj: object) -> str:
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."


def _paths(tree: PyTree) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def num_examples(tree: PyTree) -> int:
    """The size of the leading axis shared by every array of ``tree``."""
    return int(jax.tree.leaves(tree)[0].shape[0])


def example_spec(tree: PyTree) -> PyTree:
    """Abstract shape and dtype of one example (the leading axis removed)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tree)


def per_example_text(spec: PyTree) -> str:
    """One example's structure, and each leaf's dtype as JAX holds it and shape, compactly:
    data whose texts are equal take the same compiled step.

    Example:
      >>> per_example_text({"x": jax.ShapeDtypeStruct((16,), np.int64)})
      "{'x': 'int32[16]'}"
    """
    return str(jax.tree.map(lambda s: f"{held_dtype(s.dtype)}{list(s.shape)}", spec))


def epoch_order(n: int, *, shuffle: bool, seed: int | None, epoch: int) -> np.ndarray:
    """Example order for one epoch: a permutation seeded by (seed, epoch) (``seed=None``:
    a fresh random one), or 0..n-1."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng(None if seed is None else [seed, epoch]).permutation(n)


def epoch_steps(num_examples: int | None, batch: int, drop_remainder: bool,
                cap: int | None) -> int | None:
    """Batches of ``batch`` in an epoch over ``num_examples`` (``None``: a stream, unknown),
    at most ``cap`` (``steps_per_epoch``), for a progress bar.

    Example:
      >>> epoch_steps(10, 4, False, None), epoch_steps(10, 4, True, None), epoch_steps(None, 4, False, 3)
      (3, 2, 3)
    """  # noqa: E501
    if num_examples is None:
        return cap
    count = num_examples // batch if drop_remainder else -(-num_examples // batch)
    return count if cap is None else min(count, cap)


class EpochBatches:
    """The example indices of each batch of an epoch over ``num_examples`` in-memory examples
    (what both adapters' in-memory data reads).

    Without ``steps`` each epoch is one pass in the order :func:`epoch_order` gives for
    ``(seed, epoch)``, so a run resumed at an epoch reads it as the uninterrupted run did; with
    ``steps`` an epoch takes at most that many batches and the next continues the pass (a new
    pass, seeded by its number, starts when one ends). ``dropped``: examples of the last epoch
    left out by ``drop_remainder``; ``leftover``: the size of the last short batch.

    Example:
      >>> batches = EpochBatches(10)
      >>> [i.tolist() for i in batches.epoch(batch=4, shuffle=False)]
      [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
      >>> [i.tolist() for i in batches.epoch(batch=4, shuffle=False, drop_remainder=True)]
      [[0, 1, 2, 3], [4, 5, 6, 7]]
      >>> batches.dropped, batches.leftover
      (2, 2)
    """

    def __init__(self, num_examples: int) -> None:
        self.num_examples = num_examples
        self.dropped = 0
        self.leftover = num_examples
        self._order: np.ndarray | None = None
        self._position = 0
        self._passes = 0

    def epoch(self, *, batch: int, drop_remainder: bool = False, shuffle: bool = True,
              seed: int | None = 0, epoch: int = 0, steps: int | None = None
              ) -> Iterator[np.ndarray]:
        """The indices of the epoch's batches of ``batch`` examples, the last one smaller
        unless ``drop_remainder``."""
        n = self.num_examples
        if steps is None or self._order is None or self._position >= n:
            key = epoch if steps is None else self._passes
            self._order = epoch_order(n, shuffle=shuffle, seed=seed, epoch=key)
            self._position = 0
            self._passes += 1
        self.dropped = 0
        taken = 0
        while (steps is None or taken < steps) and self._position < n:
            end = min(self._position + batch, n)
            if end - self._position < batch:
                self.leftover = end - self._position
                if drop_remainder:
                    self.dropped = self.leftover
                    self._position = n
                    return
            index = self._order[self._position:end]
            self._position = end
            taken += 1
            yield index


class IndexedData(EpochBatches):
    """In-memory examples read by index: each batch of indices :meth:`EpochBatches.epoch`
    gives, as a subclass's :meth:`take` reads it."""

    def take(self, index: np.ndarray) -> PyTree:
        """The examples at ``index``."""
        raise NotImplementedError

    def epoch(self, **options: Any) -> Iterator[PyTree]:  # type: ignore[override]
        """The examples of each batch :meth:`EpochBatches.epoch` gives (same options)."""
        yield from map(self.take, super().epoch(**options))


def split_micro_batches(examples: PyTree, *, micro_batch: int, data_parallel: int = 1) -> PyTree:
    """One step's examples ``[n, ...]`` as its batches, in order: ``[k, dp * micro_batch, ...]``,
    or :class:`UnevenBatches` with a smaller last micro-batch when ``micro_batch`` does not
    divide the per-device share.
    """
    n = int(np.shape(jax.tree.leaves(examples)[0])[0])
    if n % data_parallel:
        raise ValueError(f"{n} examples do not split over {data_parallel} devices. Received: "
                         f"{n} examples, data_parallel={data_parallel}")
    steps, last = split_sizes(n // data_parallel, micro_batch)
    width = n // data_parallel if steps == 1 else micro_batch
    if last is None:
        return jax.tree.map(
            lambda a: np.reshape(np.asarray(a), (steps, width * data_parallel, *np.shape(a)[1:])),
            examples)
    cut = (steps - 1) * micro_batch * data_parallel
    return UnevenBatches(
        full=jax.tree.map(lambda a: np.reshape(np.asarray(a)[:cut], (
            steps - 1, micro_batch * data_parallel, *np.shape(a)[1:])), examples),
        last=jax.tree.map(lambda a: np.asarray(a)[cut:], examples),
    )


@dataclass(frozen=True)
class LeftoverSplit:
    """How the examples after the last full effective batch make one smaller step."""

    examples: int
    """Examples in the leftover step (fewer than the effective batch)."""
    micro_batch: int
    """Per-device micro-batch: the largest divisor of the per-device share that is at most
    the plan's micro-batch (1 when the leftover does not divide over the devices)."""
    accum_steps: int
    padding: int = 0
    """Padding slots (weight 0, change nothing) when ``examples`` does not divide over the
    data-parallel devices."""


def leftover_split(examples: int, *, micro_batch: int, data_parallel: int = 1) -> LeftoverSplit:
    """The split of a final, smaller step of ``examples`` (never above ``micro_batch``)."""
    if examples < 1:
        raise ValueError(f"A leftover step needs at least one example. Received: {examples}")
    if examples % data_parallel:
        accum = -(-examples // data_parallel)
        return LeftoverSplit(examples, 1, accum, accum * data_parallel - examples)
    per_device = examples // data_parallel
    micro = max(d for d in range(1, min(micro_batch, per_device) + 1) if per_device % d == 0)
    return LeftoverSplit(examples, micro, per_device // micro)


def leftover_batches(tree: PyTree, index: np.ndarray, split: LeftoverSplit,
                     data_parallel: int = 1) -> tuple[PyTree, np.ndarray | None]:
    """The leftover examples ``index`` shaped ``[accum, data_parallel * micro, ...]``, and
    per-example weights when the split pads (else ``None``): padding slots repeat the first
    leftover example (so the forward pass stays finite) with weight 0.
    """
    global_micro = split.micro_batch * data_parallel
    full = np.concatenate([index, np.full(split.padding, index[0], index.dtype)])
    batches = jax.tree.map(
        lambda a: a[full].reshape(split.accum_steps, global_micro, *a.shape[1:]), tree)
    if not split.padding:
        return batches, None
    weights = np.concatenate([np.ones(len(index), np.float32),
                              np.zeros(split.padding, np.float32)])
    return batches, weights.reshape(split.accum_steps, global_micro)


class Rebatcher:
    """Cuts a stream of batches of any size (a tf.data pipeline, a grain loader, a generator)
    into batches of a fixed size as they arrive, never materialising the stream.

    It keeps the examples received but not yet batched, yields each full batch as soon as it
    has one, and at the end of the data the smaller rest (or counts it as dropped). With
    ``steps`` (Keras's ``steps_per_epoch``) an epoch takes at most that many batches and the
    next epoch goes on where it stopped.

    Example:
      >>> parts = [np.arange(3), np.arange(3, 5), np.arange(5, 10)]
      >>> cut = Rebatcher()
      >>> [b.tolist() for b in cut.epoch(lambda: iter(parts), batch=4)]
      [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
      >>> cut.leftover, cut.dropped
      (2, 0)
    """

    def __init__(self) -> None:
        self._iterator: Iterator[PyTree] | None = None
        self._buffer = _Buffer()
        self.dropped = 0
        """Examples left out of the last epoch (``drop_remainder=True``)."""
        self.leftover = 0
        """Examples in the last epoch's final smaller batch (0 when it was full)."""

    def epoch(self, start: Callable[[], Iterator[PyTree]], *, batch: int,
              drop_remainder: bool = False, steps: int | None = None) -> Iterator[PyTree]:
        """The epoch's batches of ``batch`` examples, then (at the end of the data) the smaller
        rest unless ``drop_remainder``. ``start()`` begins a pass over the stream; it is
        called when no pass is under way (always, without ``steps``)."""
        if steps is None or self._iterator is None:
            self._iterator = start()
            self._buffer = _Buffer()
        self.dropped = 0
        self.leftover = 0
        taken = 0
        while steps is None or taken < steps:
            while self._buffer.count < batch:
                part = next(self._iterator, None)
                if part is None:
                    break
                self._buffer.push(part)
            if self._buffer.count >= batch:
                taken += 1
                yield self._buffer.pop(batch)
                continue
            self._iterator = None  # the data ended: the next epoch starts a new pass
            rest, self._buffer = self._buffer, _Buffer()
            self.leftover = rest.count
            if rest.count and drop_remainder:
                self.dropped = rest.count
            elif rest.count:
                yield rest.pop(rest.count)
            return


def is_one_shot(data: Any) -> bool:
    """Whether ``data`` is an iterator (``iter(data) is data``): what is read of it is gone.

    Example:
      >>> is_one_shot(iter([1, 2])), is_one_shot([1, 2])
      (True, False)
    """
    return hasattr(data, "__next__") and iter(data) is data


class ReplayedStream(Rebatcher):
    """A stream of batches, cut as :class:`Rebatcher` cuts them; what :meth:`sample` reads of
    a one-shot iterator is kept and trained first, so nothing is lost. A subclass gives
    ``_fresh(shuffle)``, one pass of its batches as numpy pytrees."""

    num_examples: int | None = None
    """Unknown for a stream."""
    no_batch: str
    """The error for a stream that yields no batch (``{name}`` and ``{type}`` filled in)."""

    def __init__(self, data: Any, *, name: str) -> None:
        super().__init__()
        self.data = data
        self.name = name
        self.one_shot = is_one_shot(data)
        self._peeked: list[PyTree] = []

    def _fresh(self, shuffle: bool) -> Iterator[PyTree]:
        raise NotImplementedError

    @property
    def held(self) -> int:
        """Examples a one-shot stream gave to planning, held to be trained first."""
        return sum(num_examples(b) for b in self._peeked)

    def sample(self, n: int) -> PyTree:
        """The stream's first ``n`` examples (fewer if shorter), for planning."""
        taken = self._peeked if self.one_shot else []
        count, fresh = sum(num_examples(b) for b in taken), self._fresh(False)
        while count < n:
            batch = next(fresh, None)
            if batch is None:
                break
            taken.append(batch)
            count += num_examples(batch)
        if not taken:
            raise ValueError(self.no_batch.format(name=self.name, type=type_name(self.data)))
        return _slice(concat(taken), 0, min(n, count))

    def epoch(self, *, batch: int, drop_remainder: bool = False,  # type: ignore[override]
              shuffle: bool = False, seed: int | None = 0, epoch: int = 0,
              steps: int | None = None) -> Iterator[PyTree]:
        """:meth:`Rebatcher.epoch` over the held batches, then a fresh pass (``shuffle`` asks
        the stream's producer; ``seed`` and ``epoch`` do not apply)."""
        del seed, epoch

        def start() -> Iterator[PyTree]:
            replay, self._peeked = self._peeked, []
            return itertools.chain(replay, self._fresh(shuffle))

        return super().epoch(start, batch=batch, drop_remainder=drop_remainder, steps=steps)


class _Buffer:
    """Examples received but not yet batched."""

    def __init__(self) -> None:
        self.parts: list[PyTree] = []
        self.count = 0

    def push(self, part: PyTree) -> None:
        self.parts.append(part)
        self.count += num_examples(part)

    def pop(self, n: int) -> PyTree:
        """The first ``n`` examples received (the rest stay)."""
        whole = concat(self.parts)
        self.parts = [_slice(whole, n, self.count)] if self.count > n else []
        self.count -= n
        return _slice(whole, 0, n)


def concat(parts: list[PyTree]) -> PyTree:
    """Batches joined along their example axis (one batch as it is)."""
    if len(parts) == 1:
        return parts[0]
    return jax.tree.map(lambda *leaves: np.concatenate(leaves, axis=0), *parts)


def _slice(tree: PyTree, start: int, stop: int) -> PyTree:
    return jax.tree.map(lambda a: a[start:stop], tree)
