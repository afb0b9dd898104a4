"""The planning option specs: validated once when built, one default per option, the plain
keywords merged into them, and the fields an entry point does not read refused."""

import dataclasses
import inspect
import re

import pytest

import autoaccum
from autoaccum.planning._plan_options import Search, Target, merge_plain, refuse_unread, spec_of


def test_a_spec_is_frozen_and_keyword_only():
    target = autoaccum.Target(device="t4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        target.device = "l4"
    with pytest.raises(TypeError):
        autoaccum.Search("nothing")


@pytest.mark.parametrize("build, match", [
    (lambda: autoaccum.Target(budget="a lot"), "Received: budget='a lot'"),
    (lambda: autoaccum.Target(strategy="zero3"), r"Use 'fsdp' for ZeRO-3.*'zero3'"),
    (lambda: autoaccum.Target(strategy="own"), r"'own' is what a plan reports.*'auto' keeps"),
    (lambda: autoaccum.Target(strategy="FSDP"), r"Did you mean 'fsdp'\? Received"),
    (lambda: autoaccum.Target(data_parallel=0), "Received: data_parallel=0"),
    (lambda: autoaccum.Search(method="fast"), "Received: method='fast'"),
    (lambda: autoaccum.Search(uneven="yes"), "Received: uneven='yes'"),
    (lambda: autoaccum.Search(remat_layers=["hidden"]),
     r"lambda path, module.*Received: remat_layers=\['hidden'\]"),
    (lambda: autoaccum.Search(cache=3), "Received: cache=3"),
    (lambda: autoaccum.Target(device="h300"), r"Did you mean 'h200'.*Received: device='h300'"),
    (lambda: autoaccum.Search(cache=""), "a folder path.*Received: cache=''"),
    (lambda: autoaccum.LearningRate(rule="cubic"), "cubic"),
    (lambda: autoaccum.LearningRate(base_batch=0), "base_batch"),
    (lambda: autoaccum.LearningRate(value=0.1, rule="linear"),
     r"needs base_batch too.*Received: rule='linear', base_batch=None"),
    (lambda: autoaccum.LearningRate(adjust_adam=True), r"Received: adjust_adam=True, base_batch"),
    (lambda: autoaccum.Training(seed=-1), "Received: seed=-1"),
])
def test_bad_fields_are_refused_when_the_spec_is_built(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_a_memory_fraction_waits_for_the_device_given_plainly():
    target = merge_plain(autoaccum.Target(memory_fraction=0.9), device="t4")
    assert (target.device, target.memory_fraction) == ("t4", 0.9)
    with pytest.raises(ValueError, match="applies to a named GPU"):
        autoaccum.Target(device="cpu", memory_fraction=0.9)


def test_a_keyword_given_plainly_fills_the_spec_and_one_given_twice_differently_is_refused():
    assert repr(merge_plain(Target(budget="1GiB"), device="t4", budget=None)) == (
        "Target(device='t4', budget='1GiB', memory_fraction=None, devices=None, hosts=1, "
        "data_parallel='auto', strategy='auto')")
    with pytest.raises(ValueError, match=re.compile(
            r"^device was given twice.* Received: device='t4', target\.device='l4'\Z",
            re.DOTALL)) as info:
        merge_plain(Target(device="l4"), device="t4")
    assert info.type is ValueError


def test_a_spec_defaults_for_none_and_a_plain_dict_is_refused():
    assert spec_of(Search, None, "search").remat == "auto"
    with pytest.raises(ValueError, match=re.compile(
            r"^search must be an autoaccum\.Search\(.*\) .* Received: "
            r"search=\{'remat': 'nothing'\}\Z", re.DOTALL)) as info:
        spec_of(Search, {"remat": "nothing"}, "search")
    assert info.type is ValueError


def test_every_entry_point_takes_the_same_default_for_the_same_spec():
    for name in ("fit", "plan", "measure", "advise", "train_step"):
        parameters = inspect.signature(getattr(autoaccum, name)).parameters
        for spec in ("target", "search", "training"):
            assert parameters[spec].default is None, (name, spec)


def test_a_field_an_entry_point_does_not_read_is_refused():
    refuse_unread("measure", "search", autoaccum.Search(cache=False), read=("cache",))
    with pytest.raises(ValueError, match=r"does not read search.objective"):
        refuse_unread("measure", "search", autoaccum.Search(objective="memory"),
                      read=("cache",))
    with pytest.raises(ValueError, match=re.compile(
            r"^measure does not read target\.budget.* Received: target\.budget='1GiB'\Z",
            re.DOTALL)) as info:
        refuse_unread("measure", "target", Target(budget="1GiB"), read=("device",))
    assert info.type is ValueError
