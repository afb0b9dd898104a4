"""Values a rematerialized Keras block appends to a list while it runs (the BatchNorm moments
``batch_stats="effective"`` records, :mod:`._keras_batch_norm`) must leave ``jax.checkpoint`` as its
outputs, or the compiled step gets stray parameters: the lists registered here are carried
out by :mod:`._keras_remat`'s checkpointed calls."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

CARRIED_SINKS: list[list] = []  # lists blocks append traced values to while they run


@contextlib.contextmanager
def carried_out_of_checkpoints(*sinks: list) -> Iterator[None]:
    """While inside, values a rematerialized block appends to ``sinks`` (BatchNorm moments
    recorded for ``batch_stats="effective"``, :mod:`._keras_batch_norm`) are returned from its
    checkpointed call and appended outside it, so no value of the inner trace escapes."""
    CARRIED_SINKS.extend(sinks)
    try:
        yield
    finally:
        for sink in sinks:
            for i, registered in enumerate(CARRIED_SINKS):
                if registered is sink:
                    del CARRIED_SINKS[i]
                    break
