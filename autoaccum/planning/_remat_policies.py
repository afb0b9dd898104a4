"""Rematerialization (gradient checkpointing) policies, by name, for every adapter.

Policies (``jax.checkpoint_policies``), in order of increasing recompute:

* ``"none"``: no rematerialization;
* ``"dots"``: keep matmul outputs, recompute the rest (``dots_saveable``);
* ``"dots_no_batch"``: keep only matmuls without batch dimensions
  (``dots_with_no_batch_dims_saveable``: weights-times-activations in a transformer);
* ``"nothing"``: keep only the block's inputs (``nothing_saveable``): least memory, most
  recompute.

``"auto"`` (planning only) tries them in this order and keeps the first under which the
step fits. Each adapter applies a policy to its model's repeated blocks
(:mod:`autoaccum.adapters.flax._nnx_program`, :mod:`autoaccum.adapters.keras._keras_program`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from ._plan import Plan
from ._search import ADVISE_HINT, DoesNotFitError

__all__ = ["REMAT_POLICIES", "validate_remat"]

REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "nothing": jax.checkpoint_policies.nothing_saveable,
}
"""Policy names in order of increasing recompute (and decreasing memory)."""


def validate_remat(policy: str) -> str:
    """Returns ``policy`` if known, else raises a ``ValueError`` listing the policies."""
    if policy not in REMAT_POLICIES and policy != "auto":
        raise ValueError(
            f"Unknown remat policy. Use 'auto' or one of {', '.join(map(repr, REMAT_POLICIES))}."
            f" Received: remat={policy!r}"
        )
    return policy


# Rematerialization policies during planning: which are tried, in order, and how the plans
# and failures of each are labelled and reported.

__all__ = ["first_line", "label_policy", "nothing_fits", "policies_for",
           "with_failed_policies"]


def policies_for(remat_policies: tuple[str, ...], remat: str) -> list[str]:
    """Policies to try for ``remat``, in order of increasing recompute: ``"auto"``, a
    framework's ``remat_policies``; a name, that one.

    Example:
      >>> policies_for(("none", "nothing"), "auto"), policies_for(("none",), "dots")
      (['none', 'nothing'], ['dots'])
    """
    validate_remat(remat)
    if remat != "auto":
        return [remat]
    return list(remat_policies)


def label_policy(plan: Plan, policy: str) -> Plan:
    """``plan`` and its probes marked with the remat ``policy`` they were compiled with."""
    probes = tuple(dataclasses.replace(p, remat=policy) for p in plan.probes)
    return dataclasses.replace(plan, probes=probes, remat=policy)


def with_failed_policies(plan: Plan, failures: list[tuple[str, DoesNotFitError]]) -> Plan:
    """``plan`` preceded by the probes of the policies under which nothing fitted (marked with
    their policy), and a note saying so."""
    if not failures:
        return plan
    earlier = tuple(dataclasses.replace(p, remat=pol) for pol, e in failures for p in e.probes)
    note = ("with less rematerialization micro_batch=1 does not fit: "
            + "; ".join(f"remat={pol}: {first_line(err)}" for pol, err in failures))
    return dataclasses.replace(plan, probes=earlier + plan.probes, notes=(*plan.notes, note))


def first_line(error: BaseException) -> str:
    return str(error).split(". ")[0]


def nothing_fits(failures: list[tuple[str, DoesNotFitError]]) -> DoesNotFitError:
    if len(failures) == 1:
        return failures[0][1]
    tried = "; ".join(f"remat={pol}: {first_line(err)}" for pol, err in failures)
    return DoesNotFitError(
        f"No rematerialization policy makes micro_batch=1 fit ({tried}). What would help: "
        "training fewer parameters (LoRA), shorter sequences, a smaller dtype (bfloat16 "
        f"weights), or a larger budget/device. {ADVISE_HINT}"
    )
