"""A package's lazily imported names: ``__getattr__`` imports a name's module on first use."""

from autoaccum.devices._lazy import lazy_exports


def test_a_lazy_name_is_imported_on_first_use_and_listed():
    getattr_, dir_ = lazy_exports("autoaccum.devices", {"format_bytes": "._profiles"})
    assert getattr_("format_bytes")(2048) == "2.00 KiB"
    assert "format_bytes" in dir_()
