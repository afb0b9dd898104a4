"""Flax's "Scale up on multiple devices" guide, both versions, trained by autoaccum inside the
guide's own mesh context (run with 8 host devices, a child of
``tests/adapters/flax/test_mesh_guides.py``).

* flax 0.12's: ``jax.set_mesh(mesh)`` on an automatic-axes mesh, weights created sharded
  (``nnx.with_partitioning`` and ``sharding=`` metadata, eager sharding), activations pinned
  with ``jax.lax.with_sharding_constraint(y, P('data', 'model'))``, layers stacked with
  ``nnx.vmap`` and run by ``jax.lax.scan``;
* flax 0.11's: the legacy ``with mesh:`` context and an ``nnx.jit`` function that creates the
  model and constrains its state to its partition specs;
* the explicit-axes variant (``AxisType.Explicit``: ``out_sharding=`` in initializers and
  ``jnp.dot``, ``jax.vmap(spmd_axis_name=None)``), inside and outside ``jax.set_mesh``;
* the smallest case: an ``nnx.Linear`` pair with one constraint.

Each: ``autoaccum.plan`` keeps the layout (``strategy == "own"``) and one accumulated step of
``autoaccum.fit`` equals the guide's own full-batch step (SGD; relative error of the
weights). Prints ``RESULT <json>``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import autoaccum

DEPTH = 64
BATCH = 8
TX = 0.1  # SGD's learning rate: the step is linear in the gradient, so errors show as they are


def _relative_error(a, b) -> float:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb), (len(la), len(lb))
    worst = 0.0
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        worst = max(worst, float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-12)))
    return worst


# -- flax 0.12's guide -----------------------------------------------------------------------

class DotReluDot(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(depth, depth,
                               kernel_init=nnx.with_partitioning(init_fn, (None, "model")),
                               use_bias=False, rngs=rngs)
        self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)), sharding=("model", None))

    def __call__(self, x):
        y = jax.nn.relu(self.dot1(x))
        y = jax.lax.with_sharding_constraint(y, P("data", "model"))
        return jnp.dot(y, self.w2[...])


class MultiDotReluDot(nnx.Module):
    def __init__(self, depth: int, num_layers: int, rngs: nnx.Rngs):
        @nnx.vmap(transform_metadata={nnx.PARTITION_NAME: None})
        def create_sublayers(r):
            return DotReluDot(depth, r)

        self.layers = create_sublayers(rngs.fork(split=num_layers))

    def __call__(self, x):
        def scan_over_layers(x, layer):
            return layer(x), None

        x, _ = jax.lax.scan(scan_over_layers, x, self.layers)
        return x


def _mse(model, batch):
    """The guide's ``mean((y_pred - y) ** 2)`` as autoaccum's (sum, count)."""
    return jnp.sum((model(batch["x"]) - batch["y"]) ** 2), batch["y"].size


def _data(seed: int = 0, n: int = BATCH) -> dict:
    rng = np.random.RandomState(seed)
    return {"x": rng.randn(n, DEPTH).astype(np.float32),
            "y": rng.randn(n, DEPTH).astype(np.float32)}


def _guide_step(model, data, mesh):
    """The guide's own train step on the whole batch (inputs put on P('data', None))."""
    optimizer = nnx.Optimizer(model, optax.sgd(TX), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    sharding = NamedSharding(mesh, P("data", None))
    x, y = (jax.device_put(data[k], sharding) for k in ("x", "y"))
    return float(train_step(model, optimizer, x, y))


def _weights(model) -> list:
    return [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _specs(model) -> list[str]:
    return [str(a.sharding.spec) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _accumulated(plan: autoaccum.Plan) -> autoaccum.Plan:
    """The plan as one step of micro-batches of one example per data device."""
    per_step = plan.effective_batch // plan.data_parallel
    return dataclasses.replace(plan, micro_batch=1, accum_steps=per_step, last_micro_batch=None)


def _trained(make, data, *, inside, mesh, batch: int = BATCH) -> dict:
    """Plans and fits one accumulated step (inside ``jax.set_mesh(mesh)`` or not) and runs the
    guide's own full-batch step on a second model made the same way: both results."""
    opts = dict(effective_batch=batch, optimizer=optax.sgd(TX), loss_fn=_mse, log=None,
                budget="1GiB", search=autoaccum.Search(cache=False))
    with inside():
        model = make()
        before = _specs(model)
        plan = autoaccum.plan(model, data, **opts)
        fit_plan = _accumulated(plan)
        result = autoaccum.fit(model, data, plan=fit_plan, verbose=0,
                               **{k: v for k, v in opts.items() if k not in ("budget", "search")},
                               training=autoaccum.Training(shuffle=False),
                               validation_data=_data(9))
    with jax.set_mesh(mesh):
        reference = make()
        loss = _guide_step(reference, data, mesh)
    return {"strategy": plan.strategy, "data_parallel": plan.data_parallel,
            "mesh_axes": [list(a) for a in plan.mesh_axes or ()],
            "split": [fit_plan.micro_batch, fit_plan.accum_steps],
            "specs_kept": before == _specs(model),
            "params_error": _relative_error(_weights(model), _weights(reference)),
            "loss_error": abs(result.losses[0] - loss) / abs(loss),
            "val_loss_finite": bool(np.isfinite(result.val_losses[0]))}


def guide_0_12() -> dict:
    auto_mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    nnx.use_eager_sharding(True)
    return _trained(lambda: MultiDotReluDot(DEPTH, 2, rngs=nnx.Rngs(0)), _data(),
                    inside=lambda: jax.set_mesh(auto_mesh), mesh=auto_mesh)


def guide_0_12_default_mesh() -> dict:
    """The same guide with ``jax.make_mesh``'s default axis types (``Explicit`` on this JAX)
    and the one-layer module: the guide's automatic-style code traces on the automatic
    copy of the mesh."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))

    def make():
        return DotReluDot(DEPTH, rngs=nnx.Rngs(0))

    opts = dict(effective_batch=BATCH, optimizer=optax.sgd(TX), loss_fn=_mse, log=None,
                budget="1GiB", search=autoaccum.Search(cache=False))
    with jax.set_mesh(mesh):
        model = make()
        plan = autoaccum.plan(model, _data(), **opts)
    return {"strategy": plan.strategy, "axis_types": [str(t) for t in mesh.axis_types]}


# -- flax 0.11's guide -----------------------------------------------------------------------

class DotReluDot011(DotReluDot):
    """The 0.11 guide's block: the same weights, read through ``.value``."""

    def __call__(self, x):
        y = jax.nn.relu(self.dot1(x))
        y = jax.lax.with_sharding_constraint(y, P("data", "model"))
        return jnp.dot(y, self.w2.value)


def guide_0_11() -> dict:
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def make():
        with nnx.use_eager_sharding(False):
            @nnx.jit
            def create_sharded_model():
                model = DotReluDot011(DEPTH, rngs=nnx.Rngs(0))
                state = nnx.state(model)
                pspecs = nnx.get_partition_spec(state)
                nnx.update(model, jax.lax.with_sharding_constraint(state, pspecs))
                return model

            with mesh:
                return create_sharded_model()

    class Legacy:
        def __enter__(self):
            self.inner = mesh.__enter__()

        def __exit__(self, *exc):
            return mesh.__exit__(*exc)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # `with mesh:` is deprecated on new JAX
        return _trained(make, _data(1), inside=Legacy, mesh=mesh)


# -- the explicit-axes variant ---------------------------------------------------------------

class ExplicitDotReluDot(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(depth, depth,
                               kernel_init=partial(init_fn, out_sharding=P(None, "model")),
                               use_bias=False, rngs=rngs)
        self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth),
                                    out_sharding=P("model", None)))
        self.b2 = nnx.Param(jnp.zeros((depth,), out_sharding=P(None)))

    def __call__(self, x):
        y = jax.nn.relu(self.dot1(x))
        z = jnp.dot(y, self.w2[...], out_sharding=P("data", None))
        return z + self.b2


class ExplicitMultiDotReluDot(MultiDotReluDot):
    """The explicit-axes stack: made by ``jax.vmap``, scanned as the guide's."""

    def __init__(self, depth: int, num_layers: int, rngs: nnx.Rngs):
        @partial(jax.vmap, spmd_axis_name=None)
        def create_sublayers(r):
            return ExplicitDotReluDot(depth, r)

        self.layers = create_sublayers(rngs.fork(split=num_layers))


def explicit() -> dict:
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)

    def make():
        with jax.set_mesh(mesh):
            return ExplicitMultiDotReluDot(DEPTH, 2, rngs=nnx.Rngs(0))

    class Outside:
        def __enter__(self):
            return None

        def __exit__(self, *exc):
            return False

    return {"inside": _trained(make, _data(2), inside=lambda: jax.set_mesh(mesh), mesh=mesh),
            "outside": _trained(make, _data(2), inside=Outside, mesh=mesh)}


# -- the smallest case -----------------------------------------------------------------------

class LinearPair(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.a = nnx.Linear(DEPTH, DEPTH, kernel_init=nnx.with_partitioning(init, (None, "model")),
                            rngs=rngs)
        self.b = nnx.Linear(DEPTH, DEPTH, kernel_init=nnx.with_partitioning(init, ("model", None)),
                            rngs=rngs)

    def __call__(self, x):
        y = jax.lax.with_sharding_constraint(self.a(x), P("data", "model"))
        return self.b(jax.nn.relu(y))


class Replicated(nnx.Module):
    """No weight annotated: the context mesh alone lays the step out."""

    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(DEPTH, DEPTH, rngs=rngs)
        self.b = nnx.Linear(DEPTH, DEPTH, rngs=rngs)

    def __call__(self, x):
        y = jax.lax.with_sharding_constraint(self.a(x), P("data", "model"))
        return self.b(jax.nn.relu(y))


def smallest() -> dict:
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    out = {"pair": _trained(lambda: LinearPair(nnx.Rngs(0)), _data(3),
                            inside=lambda: jax.set_mesh(mesh), mesh=mesh),
           "replicated": _trained(lambda: Replicated(nnx.Rngs(0)), _data(4),
                                  inside=lambda: jax.set_mesh(mesh), mesh=mesh)}
    opts = dict(effective_batch=BATCH, optimizer=optax.sgd(TX), loss_fn=_mse, log=None,
                budget="1GiB", search=autoaccum.Search(cache=False))
    with jax.set_mesh(mesh):  # code that names no axis: autoaccum's data parallelism
        plain = autoaccum.plan(nnx.Linear(DEPTH, DEPTH, rngs=nnx.Rngs(0)), _data(4), **opts)
        out["no_constraint"] = {"strategy": plain.strategy,
                                "data_parallel": plain.data_parallel}
    with jax.set_mesh(mesh):
        model = Replicated(nnx.Rngs(0))
        one = autoaccum.plan(model, _data(4), **opts, target=autoaccum.Target(data_parallel=1))
        out["one_device"] = {"strategy": one.strategy, "data_parallel": one.data_parallel}
        step = autoaccum.train_step(model, _data(4), effective_batch=BATCH,
                                    optimizer=optax.sgd(TX), loss_fn=_mse, log=None,
                                    budget="1GiB")
    outcome = step(_data(4))  # called after the block: the step keeps the caller's mesh
    out["train_step_after_block"] = {"loss": float(outcome.loss)}
    return out


class DataParallel(nnx.Module):
    """A one-axis ('data',) context mesh: weights copied, activations pinned to the batch
    split."""

    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(DEPTH, DEPTH, rngs=rngs)
        self.b = nnx.Linear(DEPTH, DEPTH, rngs=rngs)

    def __call__(self, x):
        y = jax.lax.with_sharding_constraint(self.a(x), P("data", None))
        return self.b(jax.nn.relu(y))


def one_axis() -> dict:
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    return _trained(lambda: DataParallel(nnx.Rngs(0)), _data(5, 16),
                    inside=lambda: jax.set_mesh(mesh), mesh=mesh, batch=16)


def dry_runs() -> dict:
    """Plans for devices that are not here, inside the guide's context: one GPU (the model's
    specs resolve on size-1 axes), a TPU slice of as many chips (the layout kept over them);
    a sharding strategy over Explicit axes is refused, naming them."""
    import importlib.util

    out: dict = {}
    opts = dict(effective_batch=BATCH, optimizer=optax.sgd(TX), loss_fn=_mse, log=None,
                search=autoaccum.Search(cache=False))
    auto_mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(auto_mesh):
        model = Replicated(nnx.Rngs(0))
        if importlib.util.find_spec("jax_cuda13_plugin") or importlib.util.find_spec(
                "jax_cuda12_plugin"):
            t4 = autoaccum.plan(model, _data(), **opts, device="t4")
            out["t4"] = {"strategy": t4.strategy, "data_parallel": t4.data_parallel}
        if importlib.util.find_spec("libtpu") is not None:
            v5e = autoaccum.plan(model, _data(), **opts, device="v5e-8")
            out["v5e_8"] = {"strategy": v5e.strategy, "data_parallel": v5e.data_parallel,
                            "mesh_axes": [list(a) for a in v5e.mesh_axes or ()]}
    explicit_mesh = jax.make_mesh((2, 4), ("data", "model"),
                                  axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(explicit_mesh):
        model = ExplicitDotReluDot(DEPTH, rngs=nnx.Rngs(0))
        try:
            autoaccum.plan(model, _data(), **opts, budget="1GiB",
                           target=autoaccum.Target(strategy="zero2"))
        except ValueError as error:
            out["explicit_zero2"] = str(error)
    return out


CASES = {"guide_0_12": guide_0_12, "guide_0_12_default_mesh": guide_0_12_default_mesh,
         "guide_0_11": guide_0_11, "explicit": explicit, "smallest": smallest,
         "one_axis": one_axis, "dry_runs": dry_runs}


def main(names: list[str]) -> None:
    out = {}
    for name in names or list(CASES):
        try:
            out[name] = CASES[name]()
        except Exception as error:  # reported to the test, which names the case
            import traceback

            traceback.print_exc()
            out[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
