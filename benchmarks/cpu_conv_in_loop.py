"""A convolution's kernel gradient inside a loop body on XLA:CPU, side by side: the same
arithmetic (one 3x3 convolution, 32 -> 64 channels, 14 x 14, four micro-batches of 8) as one
whole batch, accumulated in ``lax.scan`` (what autoaccum's accumulated step does), in
``lax.fori_loop``, and in a fully unrolled scan; and the forward convolution alone in a scan.

    .venv/bin/python benchmarks/cpu_conv_in_loop.py

Expect (2-core machine, jaxlib 0.10.2, XLA's default flags; measured): the kernel gradient
in a scan or fori_loop about 13x the whole batch's time (128 vs 9 ms), unrolled about as fast
as the whole batch (5 ms), the forward convolution in a scan fast (1.5 ms). In a loop body
XLA:CPU leaves the backward-filter convolution in its non-canonical form
(``dim_labels=f01b_i01o->01bf``, emitted as a naive loop) where outside a loop it becomes
``b01f_01io->b01f`` (the library path): jax-ml/jax#12868. So on a CPU a CNN's accumulated
step runs much slower than its whole-batch step (the Flax tutorial CNN, 8 x 4: 3 s a step
against 31 ms for 32 x 1); on a GPU XLA rewrites convolutions to cuDNN calls (not measured
here: no GPU). The script prints the optimised HLO's convolution labels so a newer XLA that
canonicalizes loop bodies shows it.
"""

from __future__ import annotations

import re

import _common  # noqa: F401  (environment first)
import jax
import jax.numpy as jnp
from _common import median_seconds, print_table
from jax import lax

MICRO_STEPS, MICRO_BATCH, SIDE, IN, OUT = 4, 8, 14, 32, 64
DIMENSIONS = ("NHWC", "HWIO", "NHWC")


def _conv(images: jax.Array, kernel: jax.Array) -> jax.Array:
    return lax.conv_general_dilated(images, kernel, (1, 1), "SAME",
                                    dimension_numbers=DIMENSIONS)


def _loss(kernel: jax.Array, images: jax.Array) -> jax.Array:
    return jnp.sum(_conv(images, kernel) ** 2)


def whole_batch(kernel: jax.Array, batches: jax.Array) -> jax.Array:
    return jax.grad(_loss)(kernel, batches.reshape(-1, *batches.shape[2:]))


def in_scan(kernel: jax.Array, batches: jax.Array, *, unroll: bool = False) -> jax.Array:
    def body(total, images):
        return total + jax.grad(_loss)(kernel, images), None

    return lax.scan(body, jnp.zeros_like(kernel), batches, unroll=unroll)[0]


def in_fori_loop(kernel: jax.Array, batches: jax.Array) -> jax.Array:
    def body(i, total):
        return total + jax.grad(_loss)(kernel, batches[i])

    return lax.fori_loop(0, batches.shape[0], body, jnp.zeros_like(kernel))


def forward_in_scan(kernel: jax.Array, batches: jax.Array) -> jax.Array:
    def body(total, images):
        return total + jnp.sum(_conv(images, kernel)), None

    return lax.scan(body, jnp.float32(0), batches)[0]


def main() -> None:
    kernel = jax.random.normal(jax.random.key(0), (3, 3, IN, OUT))
    batches = jax.random.normal(jax.random.key(1), (MICRO_STEPS, MICRO_BATCH, SIDE, SIDE, IN))
    cases = {
        "kernel gradient, whole batch": whole_batch,
        "kernel gradient, lax.scan (autoaccum's loop)": in_scan,
        "kernel gradient, lax.fori_loop": in_fori_loop,
        "kernel gradient, scan unrolled": lambda k, b: in_scan(k, b, unroll=True),
        "forward only, lax.scan": forward_in_scan,
    }
    rows, base = [], None
    for name, fn in cases.items():
        jitted = jax.jit(fn)
        labels = sorted(set(re.findall(r"dim_labels=(\S+?),",
                                       jitted.lower(kernel, batches).compile().as_text())))
        ms = median_seconds(lambda j=jitted: jax.block_until_ready(j(kernel, batches))) * 1e3
        base = base or ms
        rows.append([name, f"{ms:.1f}", f"{ms / base:.1f}", " ".join(labels)])
    print_table(["program", "ms (median of 5)", "x whole batch", "convolutions (dim_labels)"],
                rows)


if __name__ == "__main__":
    main()
