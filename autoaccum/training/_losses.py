"""The loss autoaccum accumulates: a *sum* over valid items and their count.

A token-mean loss (what most LLM trainers return, Tunix's and Keras's included) cannot be
accumulated exactly: the mean of per-micro-batch means weighs a token of a short micro-batch
more than one of a long one. :func:`token_loss_sum` is the common causal-LM loss written the
way autoaccum divides: it returns ``(sum of the valid tokens' cross-entropies, number of
valid tokens)``, and autoaccum divides once, by the valid tokens of the whole effective batch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = ["token_loss_sum"]


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
