"""How plans and advice show themselves: text reports, notebook HTML, tables and plots.

It shows :class:`~autoaccum.planning.Plan`, :class:`~autoaccum.planning.Advice` and
:class:`~autoaccum.planning.DoesNotFitError`; planning imports it only when one is shown
(``plan.report()``, ``repr(plan)``, a notebook's HTML).

Example:
  >>> import io
  >>> from autoaccum.reporting import print_table
  >>> out = io.StringIO()
  >>> print_table(["micro", "need"], [["4", "13.2 GiB"]], file=out, rich=False)
  >>> print(out.getvalue().strip())
  micro  need
  4      13.2 GiB
"""

from ._advice_report import error_html as error_html
from ._plan_report import plan_html as plan_html
from ._plan_report import plan_report as plan_report
from ._plan_report import plan_repr as plan_repr
from ._plan_report import print_table as print_table
from ._plot import plot_plan as plot_plan

__all__ = ["error_html", "plan_html", "plan_repr", "plan_report", "plot_plan", "print_table"]
