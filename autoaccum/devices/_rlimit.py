"""A real out-of-memory on a CPU: cap this process's address space (``RLIMIT_AS``).

Useful to rehearse what happens on an accelerator that runs out of memory (back-off, elastic
recovery) on a laptop or in CI. Only the *soft* limit is set; the hard limit stays unlimited
so the cap can be lifted again (around XLA compiles, which leave ~40 MiB of address space
behind each time and would otherwise eat the headroom). Use it in a child process: once
capped, anything that allocates (Python included) may fail.

For a repeatable boundary (the same allocation fails on every run, as tests/_oom_child.py and
benchmarks/gpu_validation.py's back-off rows rely on) set, before JAX starts,
``MALLOC_ARENA_MAX=1``, ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` (fixed
values), and ``jax.config.update("jax_cpu_enable_async_dispatch", False)``: see
:data:`CHILD_ENV`.

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
import resource
from collections.abc import Iterator

__all__ = ["CHILD_ENV", "AddressSpaceCap", "compiling", "vm_size_bytes"]

CHILD_ENV: dict[str, str] = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": "131072",
    "MALLOC_TRIM_THRESHOLD_": "131072",
    "JAX_PLATFORMS": "cpu",
    "KERAS_BACKEND": "jax",
    "TF_CPP_MIN_LOG_LEVEL": "3",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
}
"""Environment for a child process whose out-of-memory boundary should be repeatable."""


_ARMED: list[AddressSpaceCap] = []


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Lifts an armed :class:`AddressSpaceCap` around an XLA compile (no-op without one).

    autoaccum compiles inside this wherever it compiles while training or probing: on an
    accelerator a compile uses host memory, not the device's, so a cap that stands in for
    device memory should not count it (and a compile starved of address space aborts the
    process instead of raising).

    Example:
      >>> with compiling():
      ...     pass
    """
    cap = _ARMED[-1] if _ARMED else None
    if cap is None:
        yield
        return
    with cap.lifted():
        yield


def vm_size_bytes() -> int:
    """This process's virtual memory size (``VmSize`` in ``/proc/self/status``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("VmSize not found in /proc/self/status (Linux only)")


class AddressSpaceCap:
    """Caps the address space at ``VmSize + headroom_bytes`` while armed.

    ``with cap:`` arms it (relative to the VmSize at that moment); :meth:`lifted` lifts it for
    a block (a compile) and re-arms it relative to the VmSize after the block, so what the
    block leaves behind does not count. :meth:`set_headroom` moves the cap while armed (to make
    a later step fail). Allocations beyond the cap fail: XLA reports
    ``RESOURCE_EXHAUSTED: Out of memory ...`` (or, near the limit, ``YNNPACK operation
    failed``).
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
        """Lifts the soft limit to the hard limit (unlimited unless someone lowered it)."""
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
