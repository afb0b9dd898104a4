"""Option checks: how an error's "Received:" part writes the value it refuses."""

from autoaccum.planning._option_checks import received


def test_received_writes_a_short_literal_as_given_and_anything_else_by_its_type():
    assert (received("epochs", 0), received("lr_rule", "x" * 100)[:30]) == (
        "epochs=0", "lr_rule of type str (length 10")
    assert received("callbacks", [object()]) == "callbacks=[object]"
    assert received("class_weight", {0: 1.0}) == "class_weight={0: 1.0}"
