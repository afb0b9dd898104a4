"""The package version (its own module, so parts of autoaccum can read it without importing
the package root)."""

__version__ = "0.1.0"
