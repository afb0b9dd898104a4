"""Recognising a real out-of-memory error, and explaining one that no micro-batch avoids.

XLA reports running out of device memory as ``jax.errors.JaxRuntimeError`` (a
``RuntimeError``) whose message starts ``RESOURCE_EXHAUSTED:``. It can also surface masked:
cuDNN's autotuner starved of scratch ("INTERNAL: No reference output found!", "Failed to
determine best cudnn convolution algorithm"), or on CPU a kernel's scratch allocation failing
near the limit ("INTERNAL: YNNPACK operation failed"). All of them mean: less memory per step.
"""

from __future__ import annotations

import re

from ._units import format_bytes

__all__ = [
    "OOM_MARKERS", "first_line", "is_out_of_memory", "no_micro_batch_fits", "requested_bytes",
]

OOM_MARKERS: tuple[str, ...] = (
    "RESOURCE_EXHAUSTED",
    "Out of memory",
    "out of memory",
    "No reference output found",
    "Failed to determine best cudnn convolution algorithm",
    "YNNPACK operation failed",
)
"""Substrings of an XLA runtime error's message that mean the step ran out of memory."""

_REQUESTED = re.compile(r"(?:allocat\w*|request for)\s+(\d+)\s*(?:bytes|B\b)", re.IGNORECASE)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is a device out-of-memory.

    Runtime errors count: ``jax.errors.JaxRuntimeError`` (a ``RuntimeError``), and the
    ``ValueError`` with the same message that jit's C++ fast path raises when a cached
    executable is called with numpy inputs (measured, jax 0.10.2). A Python ``MemoryError``
    is the host's: a smaller micro-batch does not cure it.

    Example:
      >>> is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 8 bytes."))
      True
      >>> is_out_of_memory(ValueError("RESOURCE_EXHAUSTED: Out of memory allocating 8 bytes."))
      True
      >>> is_out_of_memory(RuntimeError("INTERNAL: YNNPACK operation failed: error"))
      True
      >>> is_out_of_memory(TypeError("RESOURCE_EXHAUSTED")), is_out_of_memory(MemoryError())
      (False, False)
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, RuntimeError | ValueError):
            message = str(current)
            if any(marker in message for marker in OOM_MARKERS):
                return True
        current = current.__cause__ or current.__context__
    return False


def first_line(error: BaseException, *, limit: int = 160) -> str:
    """The first non-empty line of ``error``'s message (no final period), at most ``limit`` long.

    Example:
      >>> first_line(RuntimeError("RESOURCE_EXHAUSTED: Out of memory\\nmore detail"))
      'RESOURCE_EXHAUSTED: Out of memory'
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = (lines[0] if lines else type(error).__name__).rstrip(".")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def requested_bytes(error: BaseException) -> int | None:
    """The allocation size an out-of-memory message names, if it names one.

    Example:
      >>> requested_bytes(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 8583 bytes."))
      8583
      >>> requested_bytes(RuntimeError("INTERNAL: YNNPACK operation failed")) is None
      True
    """
    match = _REQUESTED.search(str(error))
    return int(match.group(1)) if match else None


def no_micro_batch_fits(error: BaseException, *, need_bytes: int | None = None,
                        accum_steps: int | None = None, advice: str = "") -> str:
    """The message for a real out-of-memory at micro-batch 1: what it needed, what helps.

    Example:
      >>> msg = no_micro_batch_fits(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating "
      ...                           "2048 bytes."), need_bytes=4096)
      >>> "micro_batch=1" in msg and "4.00 KiB" in msg and "LoRA" in msg
      True
    """
    figures = []
    if need_bytes is not None and need_bytes >= 0:
        figures.append(f"the compiled step needs {format_bytes(need_bytes)}")
    requested = requested_bytes(error)
    if requested is not None:
        figures.append(f"the failed allocation asked for {format_bytes(requested)}")
    needed = f" ({'; '.join(figures)})" if figures else ""
    accum = f" x {accum_steps} accumulation steps" if accum_steps else ""
    return (
        f"A real train step ran out of memory even at micro_batch=1{accum}{needed}: "
        f"{first_line(error)}. No split of the batch fits this device. What would help: "
        "rematerialization (jax.checkpoint / nnx.remat, gradient checkpointing in Keras), "
        "training fewer parameters (LoRA), shorter sequences, a smaller dtype (bfloat16 "
        "weights and activations), freeing other live arrays, or a device with more memory. "
        f"The model's weights and optimizer state are unchanged.{(' ' + advice) if advice else ''}"
    )
