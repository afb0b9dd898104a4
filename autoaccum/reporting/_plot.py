"""Need vs micro-batch, the budget line and the choice (``autoaccum plan --plot FILE.png``).

Built on ``matplotlib.figure.Figure``, without pyplot: no pyplot state or backend change, so a
user's own ``plt.show()`` keeps working.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..devices._extras import require_extra

if TYPE_CHECKING:
    from ..planning import Plan

__all__ = ["plot_plan"]

_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def plot_plan(plan: Plan, path: str | Path | None = None, *, dpi: int = 110) -> Any:
    """Draws each probe's compiled need against its micro-batch, the budget and the choice.

    Probes that fit are dots, those over the budget red crosses (one curve per remat policy);
    the star is the chosen micro-batch, and the subtitle says what limited it: memory (the next
    micro-batch needs more than the budget) or the effective batch (it fits in one micro-batch).

    Args:
      plan: a :class:`~autoaccum.Plan` from :func:`autoaccum.plan` (or ``fit``'s plan).
      path: if given, the figure is also written there (format from the suffix).
      dpi: resolution of the saved file and of the notebook image.

    Returns:
      A ``matplotlib.figure.Figure`` (Jupyter shows it inline).

    Needs matplotlib (``pip install 'autoaccum[plot]'``).

    Example:
      >>> import tempfile, pathlib
      >>> from autoaccum_demo._tiny_lm import TinyTransformerLM, next_token_loss, text_windows
      >>> from autoaccum import plan
      >>> import optax
      >>> from flax import nnx
      >>> p = plan(TinyTransformerLM(layers=1, rngs=nnx.Rngs(0)),
      ...          text_windows("a b c d e f g h " * 8, length=8), effective_batch=4,
      ...          budget="1GiB", optimizer=optax.sgd(0.1), loss_fn=next_token_loss, log=None)
      >>> out = pathlib.Path(tempfile.mkdtemp()) / "need.png"
      >>> fig = plot_plan(p, out)
      >>> out.read_bytes()[1:4] == b"PNG", type(fig).__name__
      (True, 'PlanFigure')
    """
    require_extra("plot", feature="plot_plan (autoaccum plan --plot)")
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from ..planning import limiting_factor

    class PlanFigure(Figure):
        """A Figure that notebooks show as a PNG even when pyplot was never imported."""

        def _repr_png_(self) -> bytes:
            import io

            buffer = io.BytesIO()
            self.savefig(buffer, format="png")
            return buffer.getvalue()

    probes = sorted(plan.probes, key=lambda p: (p.remat, p.strategy, p.micro_batch))
    values = [p.need_bytes for p in probes] + [plan.budget_bytes, plan.need_bytes]
    # The largest binary unit of which the largest value is at least 1.
    unit, size = next(((n, s) for n, s in _UNITS if max(values) >= s), ("B", 1))
    fig = PlanFigure(figsize=(7.5, 4.6), dpi=dpi)
    ax = fig.add_subplot()
    chosen = (plan.remat, plan.strategy)
    policies = sorted({(p.remat, p.strategy) for p in probes},
                      key=lambda r: (r != chosen, r))
    colors = ["tab:blue", "tab:purple", "tab:orange", "tab:brown", "tab:gray"]
    failed_labelled = False
    for i, policy in enumerate(policies):
        # The last probe at a micro-batch (the verification) wins.
        by_micro = {p.micro_batch: p for p in probes if (p.remat, p.strategy) == policy}
        points = sorted(by_micro.values(), key=lambda p: p.micro_batch)
        color = colors[i % len(colors)]
        label = "compiled need" + _group_label(policy, many=len(policies) > 1)
        ax.plot([p.micro_batch for p in points], [p.need_bytes / size for p in points], "-",
                color=color, alpha=0.6, label=label)
        fits = [p for p in points if p.fits]
        ax.plot([p.micro_batch for p in fits], [p.need_bytes / size for p in fits], "o",
                color=color)
        over = [p for p in points if not p.fits]
        if over:
            ax.plot([p.micro_batch for p in over], [p.need_bytes / size for p in over], "x",
                    color="tab:red", markersize=10, markeredgewidth=2,
                    label=None if failed_labelled else "does not fit (over the budget)")
            failed_labelled = True
    ax.axhline(plan.budget_bytes / size, color="tab:red", linestyle="--", linewidth=1.2,
               label=f"budget {plan.budget_bytes / size:.3g} {unit} ({plan.budget.source})")
    ax.plot(plan.micro_batch, plan.need_bytes / size, "*", color="tab:green", markersize=18,
            markeredgecolor="black", markeredgewidth=0.6, zorder=5,
            label=f"chosen: micro_batch {plan.micro_batch} x {plan.accum_steps} accumulation")
    for p in {p.micro_batch: p for p in probes if (p.remat, p.strategy) == chosen}.values():
        ax.annotate(f"{p.need_bytes / size:.3g}", (p.micro_batch, p.need_bytes / size),
                    textcoords="offset points", xytext=(0, 9), ha="center", fontsize=7.5,
                    color="dimgray")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("micro-batch per device")
    ax.set_ylabel(f"need per step ({unit})")
    largest = max([p.micro_batch for p in probes] + [plan.micro_batch])
    ax.set_xlim(0, largest * 1.08 + 0.4)
    ax.set_ylim(0, max(values) / size * 1.15)
    where = plan.target.split(",")[0] + (" (deviceless compile)" if plan.deviceless else "")
    ax.set_title(f"effective batch {plan.effective_batch} = {plan.micro_batch} x "
                 f"{plan.data_parallel} device(s) x {plan.accum_steps} accumulation on {where}"
                 + (f", {chosen[1]}" if plan.data_parallel > 1 else ""),
                 fontsize=10)
    fig.text(0.5, 0.015, f"limited by {limiting_factor(plan).detail}", ha="center", va="bottom",
             fontsize=8.5, color="dimgray", wrap=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    if path is not None:
        fig.savefig(Path(path))
    return fig


def _group_label(group: tuple[str, str], *, many: bool) -> str:
    """`` (remat full, zero1)`` for a line of probes, or ``""``."""
    remat, strategy = group
    parts = ([f"remat {remat}"] if many or remat != "none" else []) + (
        [strategy] if many or strategy != "replicated" else [])
    return f" ({', '.join(parts)})" if parts else ""
