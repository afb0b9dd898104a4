"""Entry points' keywords: an option passed where a spec holds it is refused naming the fix."""

import re

import pytest

from autoaccum.training._training_options import explains_keywords


def _entry():
    @explains_keywords
    def entry(model, data=None, *, search=None):
        return data, search

    return entry


def test_an_option_of_a_spec_is_refused_naming_the_spec_to_pass_it_in():
    message = ("entry() takes remat inside search=: search=autoaccum.Search(remat='nothing'). "
               "Received: remat='nothing'")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _entry()(1, remat="nothing")


def test_x_is_taken_as_data():
    assert _entry()(1, x=[2]) == ([2], None)


def test_options_of_two_specs_are_refused_together_naming_both_fixes():
    @explains_keywords
    def fit(model, *, learning_rate=None, search=None):
        pass

    message = (
        "fit() takes base_batch, lr_rule, remat inside learning_rate= and search=: "
        "learning_rate=autoaccum.LearningRate(value=0.001, base_batch=1, rule='linear'), "
        "search=autoaccum.Search(remat='none'). Received: base_batch=1, lr_rule='linear', "
        "remat='none'")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        fit(1, learning_rate=1e-3, base_batch=1, lr_rule="linear", remat="none")
