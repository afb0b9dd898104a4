"""Recognising a real out-of-memory error, and explaining one that no micro-batch avoids.

XLA reports running out of device memory as ``jax.errors.JaxRuntimeError`` (a
``RuntimeError``) starting ``RESOURCE_EXHAUSTED:``, or masked: cuDNN's autotuner starved of
scratch ("INTERNAL: No reference output found!", "Failed to determine best cudnn convolution
algorithm"), or on CPU a kernel's scratch allocation failing near the limit ("INTERNAL:
YNNPACK operation failed").

``AddressSpaceCap`` makes a real out-of-memory on a CPU (``RLIMIT_AS``), to rehearse
back-off and recovery on a laptop or in CI. Only the *soft* limit is set, so the cap can be
lifted around XLA compiles (each leaves ~40 MiB of address space behind). Use it in a child
process: once capped, anything that allocates may fail. For a repeatable boundary, start JAX
with :data:`CHILD_ENV` and ``jax.config.update("jax_cpu_enable_async_dispatch", False)``.

Example:
  >>> cap = AddressSpaceCap(headroom_bytes=1 << 40)   # a cap far away: nothing fails
  >>> with cap:
  ...     with cap.lifted():
  ...         pass                                    # compile here
  >>> cap.armed
  False
"""

from __future__ import annotations

import contextlib
import re
import resource
from collections.abc import Iterator
from typing import Any

from ._profiles import format_bytes

OOM_MARKERS: tuple[str, ...] = (
    "RESOURCE_EXHAUSTED",
    "Out of memory",
    "out of memory",
    "No reference output found",
    "Failed to determine best cudnn convolution algorithm",
    "YNNPACK operation failed",
)
"""Substrings of an XLA runtime error that mean the step ran out of memory."""

_REQUESTED = re.compile(r"(?:allocat\w*|request for)\s+(\d+)\s*(?:bytes|B\b)", re.IGNORECASE)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is a device out-of-memory.

    Counts ``jax.errors.JaxRuntimeError`` (a ``RuntimeError``), and the ``ValueError`` that
    jit's C++ fast path raises for a cached executable called with numpy inputs (measured, jax
    0.10.2). A Python ``MemoryError`` is the host's: a smaller micro-batch does not cure it.

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
    """The first non-empty line of ``error``'s message, shortened to ``limit``.

    Example:
      >>> first_line(RuntimeError("RESOURCE_EXHAUSTED: Out of memory\\nmore detail"))
      'RESOURCE_EXHAUSTED: Out of memory'
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = (lines[0] if lines else type(error).__name__).rstrip(".")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def requested_bytes(error: BaseException) -> int | None:
    """The allocation size an out-of-memory message names, if it names one."""
    match = _REQUESTED.search(str(error))
    return int(match.group(1)) if match else None


def no_micro_batch_fits(error: BaseException, *, need_bytes: int | None = None,
                        accum_steps: int | None = None, advice: str = "") -> str:
    """The message for a real out-of-memory at micro-batch 1: what it needed, what helps."""
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


CHILD_ENV: dict[str, str] = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": "131072",
    "MALLOC_TRIM_THRESHOLD_": "131072",
    "JAX_PLATFORMS": "cpu",
    "KERAS_BACKEND": "jax",
    "TF_CPP_MIN_LOG_LEVEL": "3",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
}
"""Environment for a child process whose out-of-memory boundary should be repeatable (fixed
malloc thresholds)."""


_ARMED: list[AddressSpaceCap] = []


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Lifts an armed :class:`AddressSpaceCap` around an XLA compile (no-op without one).

    On an accelerator a compile uses host memory, so a cap standing in for device memory must
    not count it (and a compile starved of address space aborts instead of raising).

    Example:
      >>> with compiling():
      ...     pass
    """
    with _ARMED[-1].lifted() if _ARMED else contextlib.nullcontext():
        yield


def delete_arrays(tree: Any) -> None:
    """Deletes the device buffers of ``tree`` (a failed step's outputs), if any, so the next
    attempt has their memory."""
    import jax

    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


def vm_size_bytes() -> int:
    """This process's ``VmSize`` in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("VmSize not found in /proc/self/status (Linux only)")


class AddressSpaceCap:
    """Caps the address space at ``VmSize + headroom_bytes`` while armed.

    ``with cap:`` arms it at the VmSize of that moment; :meth:`lifted` lifts it for a block (a
    compile) and re-arms it after, so what the block leaves behind does not count.
    :meth:`set_headroom` moves the cap while armed (to make a later step fail). XLA reports
    an allocation beyond the cap as ``RESOURCE_EXHAUSTED: Out of memory ...`` (or, near the
    limit, ``YNNPACK operation failed``).
    """

    def __init__(self, *, headroom_bytes: int) -> None:
        self.headroom_bytes = int(headroom_bytes)
        self.armed = False
        self.limit_bytes: int | None = None

    def arm(self) -> None:
        """Sets the soft limit to the current VmSize plus the headroom."""
        self.limit_bytes = vm_size_bytes() + self.headroom_bytes
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (self.limit_bytes, hard))
        self.armed = True
        if self not in _ARMED:
            _ARMED.append(self)

    def disarm(self) -> None:
        """Lifts the soft limit to the hard limit."""
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        self.armed = False
        if self in _ARMED:
            _ARMED.remove(self)

    def set_headroom(self, headroom_bytes: int) -> None:
        """Changes the headroom and, if armed, re-arms relative to the current VmSize."""
        self.headroom_bytes = int(headroom_bytes)
        if self.armed:
            self.arm()

    @contextlib.contextmanager
    def lifted(self) -> Iterator[None]:
        """No cap inside the block; re-armed after it if it was armed before."""
        was_armed = self.armed
        if was_armed:
            self.disarm()
        try:
            yield
        finally:
            if was_armed:
                self.arm()

    def __enter__(self) -> AddressSpaceCap:
        self.arm()
        return self

    def __exit__(self, *exc: object) -> None:
        self.disarm()
