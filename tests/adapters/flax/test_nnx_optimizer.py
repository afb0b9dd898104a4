"""``optimizer=nnx.Optimizer(model, tx, wrt=...)``, as the Flax NNX tutorials build it: its ``tx``
and ``wrt`` are used, its state is where training starts, and the trained state and step
count are written back into it. Errors about a user's object name its type, briefly."""

import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.adapters.flax._nnx_optimizer import refuse_accumulating_optimizer, unwrap_optimizer

EFFECTIVE = 8
FROZEN = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))  # LoRAParam is a kind of Param


class LoRANet(nnx.Module):
    def __init__(self, rngs):
        self.base = nnx.Linear(4, 8, rngs=rngs)
        self.lora = nnx.LoRA(8, 2, 1, rngs=rngs)

    def __call__(self, x):
        return self.lora(jax.nn.relu(self.base(x)))


def loss_fn(model, batch):
    return jnp.sum((model(batch["x"])[:, 0] - batch["y"]) ** 2), batch["y"].shape[0]


def _data(n=2 * EFFECTIVE, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 4)).astype(np.float32),
            "y": rng.normal(size=n).astype(np.float32)}


def _fit(model, optimizer, data, **options):
    return autoaccum.fit(model, data, effective_batch=EFFECTIVE, optimizer=optimizer,
                         loss_fn=loss_fn, budget="1GiB", verbose=0, log=None,
                         **options, training=autoaccum.Training(shuffle=False))


def _by_hand(model, optimizer, data, steps):
    """What the tutorials' loop does: ``optimizer.update(model, grads)`` per effective batch."""
    def mean_loss(m, batch):
        total, count = loss_fn(m, batch)
        return total / count

    for i in range(steps):
        batch = {k: v[i * EFFECTIVE:(i + 1) * EFFECTIVE] for k, v in data.items()}
        optimizer.update(model, nnx.grad(mean_loss, argnums=nnx.DiffState(0, optimizer.wrt))(
            model, batch))


def _leaves(tree):
    return [np.asarray(a) for a in jax.tree.leaves(nnx.as_pure(tree))]


def _assert_close(a, b, **tol):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(x, y, **({"rtol": 1e-5, "atol": 1e-6} | tol))


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
@pytest.mark.parametrize("base_batch", [None, 2], ids=["rate kept", "rate scaled"])
def test_lora_optimizer_trains_its_wrt_and_holds_the_trained_state(base_batch):
    data = _data()
    model, reference = LoRANet(nnx.Rngs(0)), LoRANet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.LoRAParam)
    frozen_before = _leaves(nnx.state(model, FROZEN))
    result = _fit(model, optimizer, data,
                  learning_rate=autoaccum.LearningRate(base_batch=base_batch))
    factor = 1.0 if base_batch is None else 2.0  # sqrt(8 / 2) for Adam
    ref_opt = nnx.Optimizer(reference, optax.adam(1e-3 * factor), wrt=nnx.LoRAParam)
    _by_hand(reference, ref_opt, data, steps=2)
    assert result.steps == 2 and int(optimizer.step[...]) == 2
    _assert_close(nnx.state(model, nnx.LoRAParam), nnx.state(reference, nnx.LoRAParam))
    for a, b in zip(_leaves(nnx.state(model, FROZEN)), frozen_before, strict=True):
        np.testing.assert_array_equal(a, b)  # only wrt=nnx.LoRAParam trains
    _assert_close(optimizer.opt_state, ref_opt.opt_state)  # a checkpoint of it is the trained one


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_training_starts_from_the_optimizers_own_state():
    data = _data(3 * EFFECTIVE)
    model, reference = nnx.Linear(4, 1, rngs=nnx.Rngs(0)), nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    _by_hand(model, optimizer, data, steps=1)  # one step of the tutorial's loop first
    rest = {k: v[EFFECTIVE:] for k, v in data.items()}
    _fit(model, optimizer, rest)
    ref_opt = nnx.Optimizer(reference, optax.adam(1e-2), wrt=nnx.Param)
    _by_hand(reference, ref_opt, data, steps=3)
    assert int(optimizer.step[...]) == 3
    _assert_close(nnx.state(model), nnx.state(reference))
    _assert_close(optimizer.opt_state, ref_opt.opt_state)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_train_step_takes_an_nnx_optimizer_and_writes_it_back_every_step():
    data = _data()
    model, reference = nnx.Linear(4, 1, rngs=nnx.Rngs(0)), nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    step = autoaccum.train_step(model, data, effective_batch=EFFECTIVE, optimizer=optimizer,
                                loss_fn=loss_fn, budget="1GiB", log=None)
    ref_opt = nnx.Optimizer(reference, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    for i in range(2):
        step({k: v[i * EFFECTIVE:(i + 1) * EFFECTIVE] for k, v in data.items()})
        _by_hand(reference, ref_opt, {k: v[i * EFFECTIVE:] for k, v in data.items()}, steps=1)
        assert int(optimizer.step[...]) == i + 1
        _assert_close(optimizer.opt_state, ref_opt.opt_state)
    _assert_close(nnx.state(model), nnx.state(reference))


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_plan_takes_an_nnx_optimizer():
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    plan = autoaccum.plan(model, _data(), effective_batch=EFFECTIVE, optimizer=optimizer,
                          loss_fn=loss_fn, budget="1GiB", log=None)
    assert plan.micro_batch * plan.accum_steps == EFFECTIVE


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_an_optimizer_built_for_another_model_is_refused_briefly():
    other = nnx.Optimizer(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optax.adam(1e-3), wrt=nnx.Param)
    with pytest.raises(ValueError, match="built for another model or filter") as raised:
        _fit(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), other, _data())
    _assert_brief(str(raised.value))


def test_an_nnx_optimizer_gives_its_tx_its_wrt_and_itself():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    _, wrt, opt = unwrap_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), None)
    assert wrt is nnx.Param and type(opt).__name__ == "Optimizer"


def test_trainable_that_contradicts_the_optimizers_wrt_is_refused():
    model = LoRANet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.LoRAParam)
    with pytest.raises(ValueError, match=r"its wrt=LoRAParam.*Received: trainable of type"):
        _fit(model, optimizer, _data(), trainable=nnx.Param)


# -- errors about a user's object: its type, never its repr, under 20 lines -------------------
class Big(nnx.Module):
    """A model whose repr runs to hundreds of lines."""

    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(40)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _assert_brief(message):
    assert len(message.splitlines()) < 20, message[:3000]
    for token in ("value=Array", "Param(", "OptState(", "Linear(", "0x"):
        assert token not in message, message[:3000]


def _bad_inputs():
    big = Big(nnx.Rngs(0))
    tutorial = nnx.Optimizer(big, optax.adam(1e-3), wrt=nnx.Param)
    return {
        "optimizer is a model": dict(optimizer=big),
        "optimizer is a model state": dict(optimizer=nnx.state(big)),
        "loss_fn is an nnx.Optimizer": dict(loss_fn=tutorial),
        "callbacks hold a model": dict(callbacks=[big]),
        "callbacks is a model state": dict(callbacks=nnx.state(big)),
        "validation_data is a model": dict(validation_data=big),
        "learning_rate is a model": dict(learning_rate=big, optimizer=optax.adam),
        "effective_batch is an array": dict(effective_batch=np.arange(10_000)),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_an_error_about_a_users_object_names_its_type_in_under_20_lines(case):
    options = {"optimizer": optax.sgd(0.1), "loss_fn": loss_fn, "effective_batch": EFFECTIVE,
               **_bad_inputs()[case]}
    with pytest.raises((ValueError, TypeError)) as raised:
        autoaccum.fit(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), _data(), budget="1GiB", verbose=0,
                      log=io.StringIO(), **options)
    _assert_brief(str(raised.value))
    assert "type" in str(raised.value)


# -- an optimizer that accumulates itself (optax.MultiSteps) is refused everywhere ------------

def _multi_steps_forms():
    """Every way an optax.MultiSteps reaches optimizer=: the object, its
    gradient_transformation() (Tunix's PeftTrainer builds that), inside a chain, in an
    nnx.Optimizer, and built by a factory."""
    multi = optax.MultiSteps(optax.adamw(1e-3), 4)
    return {
        "object": lambda model: multi,
        "gradient_transformation": lambda model: multi.gradient_transformation(),
        "chain": lambda model: optax.chain(optax.clip_by_global_norm(1.0),
                                           multi.gradient_transformation()),
        "nnx_optimizer": lambda model: nnx.Optimizer(
            model, multi.gradient_transformation(), wrt=nnx.Param),
        "factory": lambda model: (lambda learning_rate: optax.MultiSteps(
            optax.sgd(learning_rate), 2).gradient_transformation()),
    }


@pytest.mark.parametrize("form", sorted(_multi_steps_forms()))
@pytest.mark.parametrize("entry", ["fit", "plan", "train_step"])
def test_an_optimizer_that_accumulates_itself_is_refused_naming_its_inner_optimizer(form, entry):
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    optimizer = _multi_steps_forms()[form](model)
    before = np.asarray(model.kernel[...]).copy()
    options = dict(effective_batch=EFFECTIVE, optimizer=optimizer, loss_fn=loss_fn,
                   budget="1GiB", log=None)
    if form == "factory":
        options["learning_rate"] = 0.1
    call = getattr(autoaccum, entry)
    if entry == "fit":
        options["verbose"] = 0
    with pytest.raises(ValueError, match=r"optax\.MultiSteps.*inner_opt.*effective_batch="):
        call(model, _data(), **options)
    np.testing.assert_array_equal(np.asarray(model.kernel[...]), before)


def test_an_optimizer_that_accumulates_itself_is_refused_and_a_plain_one_is_not():
    assert refuse_accumulating_optimizer(optax.sgd(0.1), optax.sgd(0.1),
                                         {"w": jnp.ones(2)}) is None
    multi_steps = optax.MultiSteps(optax.sgd(0.1), 4)
    with pytest.raises(ValueError, match=r"^optimizer= accumulates gradients itself "
                                         r"\(optax\.MultiSteps, "):
        refuse_accumulating_optimizer(multi_steps, multi_steps.gradient_transformation(),
                                      {"w": jnp.ones(2)})
