"""The one warning category autoaccum issues, so users (and the tests) can filter it."""

from __future__ import annotations

__all__ = ["AutoaccumWarning"]


class AutoaccumWarning(UserWarning):
    """Every warning autoaccum issues: something works, but not the way you may expect.

    Example:
      >>> import warnings
      >>> warnings.simplefilter("ignore", AutoaccumWarning)  # silence autoaccum's warnings
    """
