"""Need vs micro-batch, with the budget line: ``autoaccum plan --plot FILE.png``."""

from __future__ import annotations

from pathlib import Path

from ..devices._extras import require_extra
from ..planning._plan import Plan


def plot_plan(plan: Plan, path: str | Path) -> Path:
    """Draws each probe's compiled need against its micro-batch, the budget and the choice.

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
      >>> out = plot_plan(p, pathlib.Path(tempfile.mkdtemp()) / "need.png")
      >>> out.read_bytes()[1:4] == b"PNG"
      True
    """
    require_extra("plot", feature="plot_plan (autoaccum plan --plot)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    gib = 2**30
    probes = sorted(plan.probes, key=lambda p: p.micro_batch)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    xs = [p.micro_batch for p in probes]
    ax.plot(xs, [p.need_bytes / gib for p in probes], "o-", color="tab:blue",
            label="compiled need")
    for p in probes:
        if not p.fits:
            ax.plot(p.micro_batch, p.need_bytes / gib, "x", color="tab:red", markersize=10)
    ax.axhline(plan.budget_bytes / gib, color="tab:red", linestyle="--",
               label=f"budget {plan.budget_bytes / gib:.2f} GiB")
    ax.plot(plan.micro_batch, plan.need_bytes / gib, "*", color="tab:green", markersize=16,
            label=f"plan: {plan.micro_batch} x {plan.accum_steps} accumulation")
    ax.set_xlabel("micro-batch per device")
    ax.set_ylabel("need per step (GiB)")
    ax.set_title(f"autoaccum: effective batch {plan.effective_batch}\n{plan.target}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out
