"""Exact gradient accumulation: one ``lax.scan`` over micro-batches, one normalisation.

Why it is exact: a micro-batch's loss is a *sum* over its valid items, returned with their
count. Summing both over every micro-batch and dividing once by the total count gives exactly
the gradient of the mean loss over the whole effective batch, however the valid items (tokens,
examples) are spread across micro-batches. Dividing each micro-batch by its own count and
averaging those means (a token-mean loss, what most LLM trainers return, Tunix's and Keras's
included) weighs an item of a short micro-batch more than one of a long one: the classic
accumulation bug. :func:`token_loss_sum` is the common causal-LM loss written this way.

BatchNorm: training mode normalises each micro-batch with its own statistics, inherent to
micro-batching; ``batch_stats`` chooses how the running averages (used in eval mode) move:

* ``"effective"`` (default): ONE update per optimizer step, ``running = momentum * running +
  (1 - momentum) * stat``, from the whole effective batch's mean and variance, combined exactly
  from the micro-batch moments (equal-sized micro-batches, biased variance)::

      mean = sum_i n_i m_i / N        var = sum_i n_i (v_i + m_i**2) / N - mean**2

  as one big-batch step would, whatever micro-batch the plan picked.
* ``"micro"``: every micro-batch updates them in turn, ``accum_steps`` times per step.

The sums are float32 and, with data-parallel devices, averaged across devices before the update
(every device scans as many micro-batches), so it is exact there too.

Under ``zero1`` and ``zero2`` each device updates its share of the weights, which are then
gathered whole again, and the step selects between the new state and the old one (a non-finite
step is skipped). Left to XLA's GPU compiler that select ran on whole weights, and the
latency-hiding scheduler kept several gathered weights alive beside the old ones (many small
layers on 4 x H100 deviceless, AdamW: 1.30 times the step's floor at 4 x 1). Constraining the
selected weights to the update's split layout first makes the gather the last operation (1.10
at 4 x 1, 1.23 at 1 x 4). On host CPU devices the need is the same either way; libtpu held every
gathered weight at once with the constraint (1.32 -> 1.86 of the floor on a v5e-4), so a TPU
step keeps XLA's own choice. Figures: ``benchmarks/sharded.py --floor [--device
h100-80gb|v5e-4]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ..devices._deviceless import compile_platform
from ..devices._mesh import constrain, has_explicit_axes
from ..planning._micro_batches import UnevenBatches, micro_steps
from ..planning._option_checks import received
from ..planning._strategies import StateLayout

PyTree = Any

MicroLoss = Callable[[PyTree, PyTree, PyTree], tuple[tuple[jax.Array, jax.Array], PyTree]]
"""``micro_loss(trainable, carry, micro_batch) -> ((loss_sum, count), new_carry)``; ``carry``
(RNG counters, batch statistics, metric variables) is threaded through the micro-batches."""


class AccumulatedGradients(NamedTuple):
    """Sums over all micro-batches of one optimizer step (nothing normalised yet)."""

    grad_sum: PyTree
    """float32 sum of the gradients of every micro-batch's summed loss."""
    loss_sum: jax.Array
    """float32 sum of the per-item losses of the whole effective batch."""
    count: jax.Array
    """float32 number of valid items (tokens, examples) in the whole effective batch."""
    carry: PyTree
    """The carried state after the last micro-batch."""
    micro_grad_sq_norm_sum: jax.Array
    """Sum over micro-batches of |grad of the micro-batch mean loss|^2 (for noise-scale advice)."""


def accumulate_gradients(
    micro_loss: MicroLoss,
    trainable: PyTree,
    carry: PyTree,
    batches: PyTree,
    *,
    frozen: PyTree = None,
    scatter: Callable[[PyTree], PyTree] | None = None,
    accumulator: PyTree = None,
    sq_norm: Callable[[PyTree, jax.Array], jax.Array] | None = None,
    accumulator_sharding: PyTree = None,
) -> AccumulatedGradients:
    """Scans ``micro_loss`` over the leading axis of ``batches`` and sums gradients in float32.

    Args:
      micro_loss: ``(trainable, carry, micro_batch) -> ((loss_sum, count), new_carry)``.
      trainable: the pytree differentiated against.
      carry: state threaded through the micro-batches (may be ``None``).
      batches: a pytree whose leaves have shape ``[accum_steps, micro_batch, ...]``, or an
        :class:`UnevenBatches` (one call at the smaller micro-batch's shape, then the full
        micro-batches scanned).
      frozen: weights the loss reads but never changes (e.g. a LoRA model's base); when
        given, ``micro_loss`` takes them as a fourth argument, ``micro_loss(trainable,
        carry, micro_batch, frozen)`` (a data-parallel accumulation may split them).
      scatter: inside ``shard_map``, turns one micro-batch's float32 gradients into this
        device's share of their sum over devices (a reduce-scatter, ``zero2``/``fsdp``).
      accumulator: abstract leaves (shape) of the gradient accumulator when ``scatter``
        changes the shapes (default: the shapes of ``trainable``).
      sq_norm: ``sq_norm(grads, count)``, the squared norm of a micro-batch's mean gradient
        from the gradients ``grad_fn`` gave (default: local, ``|grads|^2 / count^2``).
      accumulator_sharding: under ``jax.jit`` over several devices (GSPMD), a sharding per
        leaf of the float32 accumulator (e.g. the weights' own), kept through the scan (over
        ``Explicit`` mesh axes each micro-batch's gradients are resharded to it first).

    Returns:
      An :class:`AccumulatedGradients` of unnormalised float32 sums.

    Example:
      >>> import jax.numpy as jnp
      >>> def micro_loss(w, carry, mb):
      ...     return (jnp.sum((mb["x"] * w) ** 2), jnp.float32(mb["x"].shape[0])), carry
      >>> acc = accumulate_gradients(micro_loss, jnp.float32(1.0), None,
      ...                            {"x": jnp.ones((4, 2))})
      >>> float(acc.count), float(acc.loss_sum), float(acc.grad_sum)
      (8.0, 8.0, 16.0)
    """

    def loss_with_aux(params: PyTree, state: PyTree, micro_batch: PyTree):
        (loss_sum, count), new_state = (micro_loss(params, state, micro_batch) if frozen is None
                                        else micro_loss(params, state, micro_batch, frozen))
        if not jnp.issubdtype(jnp.result_type(loss_sum), jnp.inexact):
            # Cast to float32 below, an integer sum would give zero gradients, silently.
            raise ValueError(
                "The micro-batch loss must be a floating-point sum: the gradient of an integer "
                "is zero, so nothing would train. Keep the sum in float (no rounding or "
                f"integer cast). Received: a loss sum of dtype {jnp.result_type(loss_sum)}")
        return jnp.asarray(loss_sum, jnp.float32), (jnp.asarray(count, jnp.float32), new_state)

    grad_fn = jax.value_and_grad(loss_with_aux, has_aux=True)
    explicit = accumulator_sharding is not None and any(
        has_explicit_axes(getattr(s, "mesh", None)) for s in jax.tree.leaves(
            accumulator_sharding, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding)))

    def body(scan_carry, micro_batch, params=trainable):
        grad_acc, loss_acc, count_acc, state, sq_acc = scan_carry
        (loss_sum, (count, state)), grads = grad_fn(params, state, micro_batch)
        summed = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        if scatter is not None:
            summed = scatter(summed)
        if explicit:  # a sharding is part of an array's type: the sum takes the accumulator's
            summed = constrain(summed, accumulator_sharding)
        grad_acc = jax.tree.map(lambda a, g: a + g, grad_acc, summed)
        if accumulator_sharding is not None:
            grad_acc = constrain(grad_acc, accumulator_sharding)
        if sq_norm is not None:
            micro_sq = sq_norm(grads, count)
        else:
            safe = jnp.maximum(count, 1.0)
            # Scale the scalar, not the tree, so no gradient-sized temporary is needed.
            micro_sq = tree_sq_norm(grads) / (safe * safe)
        return (grad_acc, loss_acc + loss_sum, count_acc + count, state, sq_acc + micro_sq), None

    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32),
                         trainable if accumulator is None else accumulator)
    if accumulator_sharding is not None:
        zeros = constrain(zeros, accumulator_sharding)
    init = (zeros, jnp.float32(0), jnp.float32(0), carry, jnp.float32(0))
    params = trainable
    if isinstance(batches, UnevenBatches) and micro_steps(batches) == 2:
        # A two-step loop picking one micro-batch by lax.cond holds only the larger one's
        # buffers (straight-line, XLA:CPU kept both: 1.69 MB vs 1.40 MB for 5 + 2, a test LM).
        out = _two_micro_batches(body, init, batches)
    else:
        if isinstance(batches, UnevenBatches):
            # The smaller micro-batch seeds the loop's carry; the barrier makes the loop wait,
            # so its temporaries are dead (without it a deviceless T4 step needed 12% more for
            # 5 + 2).
            init, _ = body(init, batches.last)
            init, params = jax.lax.optimization_barrier((init, trainable))
            batches = batches.full
        if jax.tree.leaves(batches)[0].shape[0] == 1:
            # No loop: XLA:CPU runs convolutions inside a while loop several times slower.
            out, _ = body(init, jax.tree.map(lambda b: b[0], batches), params)
        else:
            out, _ = jax.lax.scan(lambda c, b: body(c, b, params), init, batches)
    return AccumulatedGradients(*out)


def tree_sq_norm(tree: PyTree) -> jax.Array:
    """``sum(|leaf|^2)`` over the leaves of ``tree``, in float32.

    The partitioner keeps this split (a one-scalar all-reduce); ``jnp.vdot`` flattens its
    operands, and that reshape gathered a leaf split over a mesh axis other than its first on
    every device.

    Example:
      >>> import jax.numpy as jnp
      >>> float(tree_sq_norm({"a": jnp.ones((2, 3)), "b": jnp.full((2,), 2.0, jnp.bfloat16)}))
      14.0
    """
    return sum((jnp.sum(jnp.square(jnp.asarray(g, jnp.float32)))
                for g in jax.tree.leaves(tree)), jnp.float32(0))


def _two_micro_batches(body: Any, init: Any, batches: UnevenBatches) -> Any:
    """``body`` over the smaller micro-batch, then the full one, as a two-step loop."""
    def full(carry: Any, i: jax.Array) -> Any:  # sliced inside the branch, as a scan would
        one = jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, i - 1, keepdims=False),
                           batches.full)
        return body(carry, one)[0]

    def step(carry: Any, i: jax.Array) -> tuple[Any, None]:
        return jax.lax.cond(i == 0, lambda c: body(c, batches.last)[0],
                            lambda c: full(c, i), carry), None

    out, _ = jax.lax.scan(step, init, jnp.arange(2))
    return out


def mean_gradients(accumulated: AccumulatedGradients, like: PyTree) -> PyTree:
    """Divides the summed gradients by the total valid count, cast to the dtypes of ``like``.

    A step with no valid item at all yields zero gradients rather than NaN.

    Example:
      >>> import jax.numpy as jnp
      >>> acc = AccumulatedGradients(jnp.float32(6.0), jnp.float32(0), jnp.float32(3),
      ...                            None, jnp.float32(0))
      >>> float(mean_gradients(acc, jnp.zeros((), jnp.bfloat16)))
      2.0
    """
    denominator = jnp.maximum(accumulated.count, 1.0)
    return jax.tree.map(
        lambda g, p: (g / denominator).astype(jnp.result_type(p)), accumulated.grad_sum, like
    )


def mean_loss(accumulated: AccumulatedGradients) -> jax.Array:
    """The mean per-item loss of the whole effective batch (0 when nothing was valid).

    Example:
      >>> import jax.numpy as jnp
      >>> acc = AccumulatedGradients(None, jnp.float32(6.0), jnp.float32(4), None,
      ...                            jnp.float32(0))
      >>> float(mean_loss(acc))
      1.5
    """
    return accumulated.loss_sum / jnp.maximum(accumulated.count, 1.0)


BATCH_STATS_MODES = ("effective", "micro")


def validate_batch_stats(mode: object) -> str:
    """Returns ``mode`` if it is ``"effective"`` or ``"micro"``, else a ``ValueError``.

    Example:
      >>> validate_batch_stats("micro")
      'micro'
    """
    if mode not in BATCH_STATS_MODES:
        raise ValueError(
            "batch_stats must be 'effective' (BatchNorm running averages move once per optimizer "
            "step, from the whole effective batch's mean and variance) or 'micro' (once per "
            f"micro-batch). Received: {received('batch_stats', mode)}"
        )
    return str(mode)


class Moments(NamedTuple):
    """Float32 sums over the micro-batches of one optimizer step, for one BatchNorm layer."""

    mean_sum: jax.Array
    """Sum of weight x micro-batch mean."""
    square_sum: jax.Array
    """Sum of weight x (micro-batch variance + mean**2): the second moment."""
    weight: jax.Array
    """Sum of the micro-batch weights (1 per real micro-batch, 0 for padding)."""
    updated: jax.Array
    """> 0 when some micro-batch updated the statistics (train mode); 0 in eval mode."""


def zero_moments(like: Any) -> Moments:
    """Empty sums shaped like the running mean ``like``.

    Example:
      >>> zero_moments(jnp.zeros(3)).mean_sum.shape
      (3,)
    """
    zeros = jnp.zeros(jnp.shape(like), jnp.float32)
    return Moments(zeros, zeros, jnp.float32(0), jnp.float32(0))


def add_moments(moments: Moments, mean: Any, var: Any, *, weight: Any = 1.0,
                updated: Any = True) -> Moments:
    """``moments`` plus one micro-batch's ``mean`` and (biased) ``var`` with ``weight``;
    ``updated``: whether the layer computed statistics (not in eval mode).

    Example:
      >>> m = add_moments(zero_moments(jnp.zeros(1)), jnp.ones(1), jnp.zeros(1))
      >>> float(m.mean_sum[0]), float(m.square_sum[0]), float(m.weight)
      (1.0, 1.0, 1.0)
    """
    mean, var = jnp.asarray(mean, jnp.float32), jnp.asarray(var, jnp.float32)
    w = jnp.asarray(weight, jnp.float32) * jnp.asarray(updated, jnp.float32)
    return Moments(moments.mean_sum + w * mean,
                   moments.square_sum + w * (var + mean * mean),
                   moments.weight + w,
                   jnp.maximum(moments.updated, w))


def running_update(running_mean: Any, running_var: Any, moments: Moments,
                   momentum: float) -> tuple[jax.Array, jax.Array]:
    """One running-average update from the effective batch's mean and variance (unchanged
    when no micro-batch updated them).
    """
    total = jnp.maximum(moments.weight, 1e-30)
    mean = moments.mean_sum / total
    var = jnp.maximum(moments.square_sum / total - mean * mean, 0.0)
    new_mean = momentum * running_mean + (1 - momentum) * mean
    new_var = momentum * running_var + (1 - momentum) * var
    keep = moments.updated <= 0
    return (jnp.where(keep, running_mean, new_mean).astype(jnp.result_type(running_mean)),
            jnp.where(keep, running_var, new_var).astype(jnp.result_type(running_var)))


def split_until_gathered(new_params: Any, layout: StateLayout | None) -> Any:
    """A step's selected new weights constrained to the optimizer's update layout
    (``layout.reduced``) under ``zero1``/``zero2``, except on TPU (see the module docstring);
    the caller then constrains them to ``layout.params``.
    """
    if (layout is None or layout.reduced is None or layout.strategy not in ("zero1", "zero2")
            or compile_platform() == "tpu"):
        return new_params
    return jax.lax.with_sharding_constraint(new_params, layout.shardings(layout.reduced))


def token_loss_sum(logits: Any, targets: Any, mask: Any = None) -> tuple[jax.Array, jax.Array]:
    """Softmax cross-entropy of integer ``targets`` under ``logits``, summed over the tokens
    ``mask`` keeps, and the number of those tokens: a ``loss_fn``'s return value.

    Args:
      logits: ``[..., vocab]`` (any float dtype; computed in float32).
      targets: integer token ids, ``logits.shape[:-1]``.
      mask: which tokens count (``1``/``True``), ``targets.shape``; ``None``: every token.

    Returns:
      ``(loss_sum, count)``, two float32 scalars.

    Raises:
      ValueError: the shapes do not line up (the message gives them).

    Example:
      >>> import jax.numpy as jnp
      >>> logits = jnp.zeros((2, 3, 4))  # uniform over 4 tokens: log(4) each
      >>> targets = jnp.array([[1, 2, 0], [3, 0, 0]])
      >>> mask = jnp.array([[1, 1, 1], [1, 0, 0]])
      >>> total, count = token_loss_sum(logits, targets, mask)
      >>> round(float(total / count), 4), float(count)
      (1.3863, 4.0)

    A causal LM's loss over right-padded rows (next-token targets, padding masked), as a
    ``loss_fn`` (``batch["tokens"]`` and ``batch["mask"]`` are ``[batch, seq]``)::

        def loss_fn(model, batch):
            logits = model(batch["tokens"][:, :-1])
            return autoaccum.training.token_loss_sum(logits, batch["tokens"][:, 1:],
                                            batch["mask"][:, 1:])
    """
    logits, targets = jnp.asarray(logits), jnp.asarray(targets)
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            "token_loss_sum takes logits [..., vocab] and targets of logits.shape[:-1] (one "
            "token id per position). Received: logits of shape "
            f"{logits.shape}, targets of shape {targets.shape}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(
            "token_loss_sum takes integer token ids as targets (for one-hot or soft targets "
            "use optax.softmax_cross_entropy and sum it). Received: targets of dtype "
            f"{targets.dtype}")
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                             targets)
    if mask is None:
        return jnp.sum(losses), jnp.float32(losses.size)
    mask = jnp.asarray(mask)
    if mask.shape != targets.shape:
        raise ValueError(
            "token_loss_sum's mask has one entry per target token. Received: mask of shape "
            f"{mask.shape}, targets of shape {targets.shape}")
    weights = mask.astype(jnp.float32)
    return jnp.sum(losses * weights), jnp.sum(weights)
