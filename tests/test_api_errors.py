"""Bad input fails early with a message that names the fix."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.planning._option_checks import validate_effective_batch
from tests._models import TinyLM, ragged_tokens, token_loss


def _fit(**overrides):
    kwargs = {
        "effective_batch": 4,
        "optimizer": optax.sgd(0.1),
        "loss_fn": token_loss,
        "budget": "1GiB",
        "verbose": 0,
        "log": None,
    }
    kwargs.update(overrides)
    data = kwargs.pop("data", ragged_tokens(8, 6))
    return autoaccum.fit(TinyLM(rngs=nnx.Rngs(0)), data, **kwargs)


@pytest.mark.parametrize("bad", [0, -4, 2.5, "8", True])
def test_effective_batch_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match=r"positive integer.*Received: effective_batch="):
        _fit(effective_batch=bad)


def test_a_budget_for_a_plan_by_real_steps_alone_is_refused():
    # method="backoff" backs off where the device runs out of memory: no budget bounds it.
    with pytest.raises(ValueError, match=r"method='backoff' plans by real steps alone.*"
                                         r"Received: method='backoff', budget='132KiB'"):
        _fit(budget="132KiB", search=autoaccum.Search(method="backoff"))


def test_effective_batch_not_multiple_of_devices_names_nearest_sizes():
    with pytest.raises(ValueError, match=r"nearest valid sizes: 6 or 9 \(or split 7 over 1 "
                                         r"device: target=autoaccum\.Target\(data_parallel=1"):
        validate_effective_batch(7, data_parallel=3)
    with pytest.raises(ValueError, match=r"8 or 16 \(or split 12 over 4 devices: "
                                         r"target=autoaccum\.Target\(data_parallel=4\)\)"):
        validate_effective_batch(12, data_parallel=8)


def test_mismatched_leading_axes_are_listed():
    data = {"tokens": np.zeros((8, 6), np.int32), "mask": np.ones((7, 6), np.int32)}
    with pytest.raises(ValueError, match=r"same number of examples.*\['mask'\]: 7"):
        _fit(data=data)


@pytest.mark.parametrize("data", [{}, (), {"tokens": np.zeros((0, 6), np.int32)}])
def test_empty_data_is_refused(data):
    with pytest.raises(ValueError, match="empty"):
        _fit(data=data)


def test_scalar_without_example_axis_is_refused():
    with pytest.raises(ValueError, match="leading example axis"):
        _fit(data={"tokens": np.int32(3)})


def test_fewer_examples_than_one_effective_batch():
    with pytest.raises(ValueError, match=r"3 examples, fewer than one effective batch of 4"):
        _fit(data=ragged_tokens(3, 6))


def test_unknown_lr_rule():
    with pytest.raises(ValueError, match="Unknown learning-rate rule"):
        _fit(learning_rate=autoaccum.LearningRate(rule="quadratic"))


def test_unparseable_budget():
    with pytest.raises(ValueError, match="Received: budget='a lot'"):
        _fit(budget="a lot")


def test_missing_loss_fn_and_optimizer_explain_the_contract():
    with pytest.raises(ValueError, match=r"sum_of_losses, number_of_valid_items"):
        _fit(loss_fn=None)
    with pytest.raises(ValueError, match="optax.adamw"):
        _fit(optimizer=None)


def test_loss_fn_returning_a_mean_explains_the_contract():
    with pytest.raises(ValueError, match=r"must return \(sum_of_losses, number_of_valid_items\)"
                                         r".*Received: one scalar \(a mean\?\)"):
        _fit(loss_fn=lambda m, b: token_loss(m, b)[0])
    with pytest.raises(ValueError, match=r"Received: a tuple of 3"):
        _fit(loss_fn=lambda m, b: (*token_loss(m, b), 0))
    with pytest.raises(ValueError, match=r"Received: a dict with keys \['count', 'loss'\]"):
        _fit(loss_fn=lambda m, b: dict(zip(("loss", "count"), token_loss(m, b), strict=True)))
    with pytest.raises(ValueError, match=r"Received: None \(does loss_fn end with a return"):
        _fit(loss_fn=lambda m, b: None)


def test_an_integer_loss_sum_is_refused_not_trained_with_zero_gradients():
    # Cast to float inside the step, an integer sum would have zero gradients: nothing would
    # train and the losses would still be logged.
    def rounded(model, batch):
        total, count = token_loss(model, batch)
        return jnp.round(total).astype(jnp.int32), count

    with pytest.raises(ValueError, match=r"floating-point sum_of_losses.*Received: "
                                         r"sum_of_losses of dtype int32"):
        _fit(loss_fn=rounded)


def test_unknown_model_type_names_supported_frameworks():
    with pytest.raises(ValueError, match="Flax NNX modules"):
        autoaccum.plan(object(), ragged_tokens(8, 6), effective_batch=4)


def test_batch_size_with_effective_batch_names_the_fix():
    with pytest.raises(ValueError, match=r"pass `effective_batch=`.*Received: batch_size=4"):
        _fit(batch_size=4)


def test_an_option_of_a_spec_given_plainly_names_the_spec():
    with pytest.raises(ValueError, match=r"search=autoaccum.Search\(remat='nothing'\)"):
        _fit(remat="nothing")
    with pytest.raises(ValueError, match=r"LearningRate\(base_batch=1\).*Received: base_batch=1"):
        _fit(base_batch=1)


def test_a_plain_option_given_again_in_its_spec_is_refused():
    with pytest.raises(ValueError, match=r"device was given twice.*target.device='l4'"):
        _fit(device="t4", target=autoaccum.Target(device="l4"))


def test_a_spec_of_the_wrong_kind_names_the_class():
    with pytest.raises(ValueError, match=r"search must be an autoaccum.Search"):
        _fit(search={"remat": "none"})


def test_fit_takes_at_most_25_parameters():
    import inspect

    assert len(inspect.signature(autoaccum.fit).parameters) <= 25


def test_unexpected_option_is_a_type_error_listing_the_keywords_taken():
    with pytest.raises(TypeError, match=r"micro_steps.*; it takes model, data, y, "
                                        r"effective_batch"):
        _fit(micro_steps=4)
    with pytest.raises(TypeError, match=r"measure\(\) got an unexpected keyword argument "
                                        r"'log'; it takes .*micro_batch"):
        autoaccum.measure(TinyLM(rngs=nnx.Rngs(0)), ragged_tokens(8, 6), micro_batch=2,
                          log=None)


def test_a_device_index_is_refused_with_the_profile_names():
    with pytest.raises(ValueError, match=r"profile such as 't4'.*Received: device=0"):
        _fit(device=0)
    with pytest.raises(ValueError, match="Received: device=0"):
        autoaccum.plan(TinyLM(rngs=nnx.Rngs(0)), ragged_tokens(8, 6), effective_batch=4,
                       optimizer=optax.sgd(0.1), loss_fn=token_loss, device=0, log=None)


@pytest.mark.parametrize("fraction", ["0.9", 0, 1.5, True])
def test_memory_fraction_must_be_a_number_in_0_1(fraction):
    with pytest.raises(ValueError, match=r"number in \(0, 1\].*Received: memory_fraction="):
        _fit(device="t4", target=autoaccum.Target(memory_fraction=fraction))


@pytest.mark.parametrize("device", [None, "cpu"])
def test_memory_fraction_without_a_gpu_device_names_the_fix(device):
    with pytest.raises(ValueError, match=r"applies to a named GPU.*pass budget="):
        _fit(device=device, target=autoaccum.Target(memory_fraction=0.5))


@pytest.mark.parametrize("rate", ["abc", -1e-3, 0.0, float("nan"), float("inf")])
def test_bad_learning_rates_are_refused(rate):
    with pytest.raises(ValueError, match=r"learning_rate must be a positive.*Received"):
        _fit(optimizer=optax.sgd, learning_rate=rate)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_numpy_integers_are_accepted_for_sizes_and_budgets():
    result = _fit(optimizer=optax.sgd, budget=np.int64(2**30),
                  learning_rate=autoaccum.LearningRate(value=0.1, base_batch=np.int64(4)),
                  effective_batch=np.int64(4), epochs=np.int32(1))
    assert result.steps == 2 and result.plan.lr_factor == 1.0


def test_ragged_python_lists_are_explained():
    data = {"tokens": [[1, 2, 3], [4, 5]], "mask": [[1, 1, 1], [1, 1]]}
    with pytest.raises(ValueError, match=r"data\['tokens'\] is ragged.*Pad every row"):
        _fit(data=data)


def test_string_arrays_are_explained():
    data = {"tokens": np.array(["a b", "c d"]), "mask": np.ones((2, 3), np.int32)}
    with pytest.raises(ValueError, match=r"data\['tokens'\] holds strings.*Tokenize"):
        _fit(data=data)


def test_per_example_losses_are_explained():
    def per_example(model, batch):
        total, count = token_loss(model, batch)
        return jnp.full((batch["tokens"].shape[0],), total), count

    with pytest.raises(ValueError, match=r"two scalars.*sum_of_losses has shape \(\d+,\)"):
        _fit(loss_fn=per_example)


def test_an_optimizer_factory_that_returns_no_optax_transformation():
    with pytest.raises(ValueError, match=r"must return an optax GradientTransformation.*str"):
        _fit(optimizer=lambda learning_rate: "sgd", learning_rate=0.1)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_log_stdout_prints_there_and_unknown_log_names_are_refused(capsys):
    _fit(log="stdout", verbose=1)
    assert "autoaccum plan" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"'stderr', 'stdout'.*Received: log='plan.txt'"):
        _fit(log="plan.txt")


def test_a_cpu_budget_above_the_machines_ram_is_refused():
    with pytest.raises(ValueError, match=r"more than this machine's RAM.*Received: budget="):
        _fit(budget="4096TiB")


def test_a_second_positional_for_a_flax_model_says_to_pass_x_y_as_one_argument():
    tokens = ragged_tokens(8, 6)
    with pytest.raises(ValueError, match=r"Flax model takes its data as one argument.*"
                       r"pass `\(x, y\)`.*Received: y of type "
                       r"numpy.ndarray with shape \(8, 6\) and dtype int32") as info:
        _fit(data=tokens["tokens"], y=tokens["tokens"])
    assert "[[" not in str(info.value)  # no array printed


def test_a_refused_fit_option_names_the_value_s_type_and_shape_never_the_array():
    weights = np.arange(1000, dtype=np.float32)
    with pytest.raises(ValueError) as info:
        _fit(sample_weight=weights)
    message = str(info.value)
    assert "sample_weight of type numpy.ndarray with shape (1000,) and dtype float32" in message
    assert "999" not in message and len(message) < 600
    with pytest.raises(ValueError, match=r"Received: class_weight=\{0: 1.0, 1: 2.0\}"):
        _fit(class_weight={0: 1.0, 1: 2.0})


class _Wide(nnx.Module):
    """No sequence of blocks to checkpoint; activations of 512 x 256 floats per example."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden, self.out = nnx.Linear(16, 256, rngs=rngs), nnx.Linear(256, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))[..., 0].mean(-1)


def test_micro_batch_one_over_the_budget_says_remat_was_not_tried_and_how_to_ask():
    data = {"x": np.ones((16, 512, 16), np.float32), "y": np.zeros(16, np.float32)}

    def loss_fn(m, b):
        return jnp.sum((m(b["x"]) - b["y"]) ** 2), b["y"].shape[0]

    with pytest.raises(autoaccum.DoesNotFitError,
                       match=r"Rematerialization was not tried: autoaccum found no sequence "
                             r"of blocks.*Search\(remat_layers=\.\.\.\).*\(nnx\.remat"):
        autoaccum.plan(_Wide(nnx.Rngs(0)), data, effective_batch=8, optimizer=optax.sgd,
                       learning_rate=0.1, loss_fn=loss_fn, budget="600KiB", log=None,
                       search=autoaccum.Search(cache=False))


def test_a_keras_model_without_blocks_is_pointed_to_keras_own_remat():
    import keras

    model = keras.Sequential([keras.Input((512, 16)), keras.layers.Dense(256, "tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((16, 512, 16), np.float32), np.zeros((16, 512, 1), np.float32)
    with pytest.raises(autoaccum.DoesNotFitError,
                       match=r"Rematerialization was not tried.*\(keras\.RematScope"):
        autoaccum.plan(model, (x, y), effective_batch=8, budget="900KiB", log=None,
                       search=autoaccum.Search(cache=False))


def test_no_accumulating_step_fitting_points_to_advise():
    data = {"x": np.ones((8, 64), np.float32), "y": np.zeros((8, 64), np.float32)}

    def loss_fn(m, b):
        return jnp.sum((m(b["x"]) - b["y"]) ** 2), b["y"].shape[0]

    with pytest.raises(autoaccum.DoesNotFitError,
                       match=r"No micro-batch fits: every accumulating step.*"
                             r"autoaccum\.advise\(\.\.\.\)"):
        autoaccum.plan(nnx.Linear(64, 64, rngs=nnx.Rngs(0)), data, effective_batch=8,
                       optimizer=optax.sgd, learning_rate=0.1, loss_fn=loss_fn,
                       budget="30KiB", log=None, search=autoaccum.Search(cache=False))


@pytest.mark.parametrize("verbose", ["bogus", 3, -1, 1.5, None])
def test_a_verbose_keras_would_not_take_is_refused(verbose):
    with pytest.raises(ValueError, match=rf"verbose is 0 .*Received: verbose={verbose!r}"):
        _fit(verbose=verbose)
