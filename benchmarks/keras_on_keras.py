"""Keras on Keras (issue 40, item 5): autoaccum's accumulated step run by Keras's own ``fit``.

What it tries: a compiled Keras model's ``train_function`` (the attribute Keras's JAX trainer
calls once per step, ``train_function(state, iterator) -> (logs, state)``;
keras/src/backend/jax/trainer.py, ``make_train_function``/``_make_function``) is replaced,
after ``compile``, by :class:`AccumulatedTrainFunction`: it takes the effective batch Keras's
epoch iterator yields, splits it inside one jitted, donating program into micro-batches of
``m`` (10 = 4 + 4 + 2, an uneven last micro-batch; the epoch's last batch of 5 = 4 + 1) and
runs autoaccum's own accumulated step on it (``adapters/keras/_step.keras_train_step``: loss
sums and counts summed, divided once, the optimizer applied once). Everything else is
Keras's: ``model.fit(x, y, batch_size=EFFECTIVE, validation_data=..., callbacks=[...])``, its
data adapters, epoch iterator, keras-hub preprocessing, validation (Keras's own
``test_step`` at ``validation_batch_size``), callbacks and ``History``. Each row below is
computed against plain ``model.fit(batch_size=EFFECTIVE)`` on a twin with the same initial
weights (float32, CPU); nothing is asserted, the verdict column only reads the numbers.

Run (about 2 1/2 minutes on 2 idle CPU cores, 5 on 2 shared, loaded ones)::

    .venv/bin/python benchmarks/keras_on_keras.py

Measured (Keras 3.15.1, keras-hub 0.32, jax 0.12.0.1, CPU, float32; 25 examples at effective
batch 10, so steps of 10, 10, 5 per epoch, 2 epochs; "diff": max |weight difference| vs plain
``model.fit(batch_size=10)``; "loss": max |History loss difference|)::

    row                                             measured                                verdict
    a  SGD   m=5 (10=5+5, last 5)                   diff 3.0e-08 loss 2.4e-07 calls 6       holds
    a  SGD   m=4 (10=4+4+2, last 5=4+1)             diff 3.0e-08 loss 2.4e-07 calls 6       holds
    a  SGD   m=3 (10=3+3+3+1, last 5=3+2)           diff 3.0e-08 loss 2.4e-07 calls 6       holds
    a  SGD   control: plain fit at batch_size=4     diff 1.4e-01 (must be large)            holds
    a  AdamW m=5 (10=5+5, last 5)                   diff 3.0e-08 loss 2.4e-07 calls 6       holds
    a  AdamW m=4 (10=4+4+2, last 5=4+1)             diff 3.0e-08 loss 1.2e-07 calls 6       holds
    a  AdamW m=3 (10=3+3+3+1, last 5=3+2)           diff 3.0e-08 loss 0.0e+00 calls 6       holds
    a  AdamW m=4, steps_per_execution=2             diff 3.0e-08 steps 6                    holds
    a  AdamW control: plain fit at batch_size=4     diff 8.9e-02 (must be large)            holds
    b  History + validation_data, 4 keys            keys equal, max diff 1.2e-07            holds
    b  EarlyStopping(restore_best)+ModelCheckpoint  diff 6.0e-08, ckpt diff 6.0e-08         holds
    b  BackupAndRestore: fail in epoch 2, resume    diff 3.0e-08 (vs same on plain)         holds
    c  KeyboardInterrupt from a callback, step 2    diff 3.0e-08 vs 2 steps, iters 2        holds
    c  Ctrl-C in step 2, plain Keras fit            weights are deleted (donated) arrays    FAILS
    c  Ctrl-C in step 2, unguarded (Keras's way)    weights are deleted (donated) arrays    FAILS
    c  Ctrl-C in step 2, guarded + _jax_state set   diff 3.0e-08 vs 2 steps, iters 2        holds
    d  OOM before dispatch (compile), m 4 -> 2      diff 3.0e-08 events ['m 4->2']          holds
    d  OOM after dispatch, state donated, no copy   RuntimeError; weights purged (None)     FAILS
    d  OOM after dispatch, host copy every step     diff 3.0e-08 events ['m 4->2']          holds
    d  OOM after dispatch, donation off (2x state)  diff 3.0e-08 events ['m 4->2']          holds
    e  keras-hub GPT2CausalLM on raw strings, m=3   diff 6.6e-08 loss diff 0.0e+00          holds
    e  keras-hub Gemma3 demo (SentencePiece), m=2   NotFoundError in tf.data                FAILS

What the rows say:

* a, b, e (GPT-2): exact to float32 rounding (one ulp), even, uneven and the epoch's partial
  last batch, SGD and AdamW; History, validation, EarlyStopping, ModelCheckpoint (it syncs
  the state mid-epoch through ``Callback.model``, callbacks/callback.py:92-99) and
  BackupAndRestore are Keras's own and unchanged.
* c: a ``KeyboardInterrupt`` between steps leaves a whole step (Keras's ``finally:
  jax_state_sync()``, backend/jax/trainer.py:532-533, writes ``_jax_state``, set after each
  step at :472). A Ctrl-C while a step runs, after dispatch and before Keras sets
  ``_jax_state``, leaves the model holding the previous step's donated, deleted arrays,
  in Keras's own fit too; holding Ctrl-C (autoaccum's ``deferred_interrupts``) and setting
  ``model._jax_state`` inside the train function fixes it.
* d: a compile-time out-of-memory (before the donating call) is redone at a smaller
  micro-batch from the same state. After dispatch the state was donated, and Keras purged the
  model's variables at the epoch's first step (``_purge_model_variables``, trainer.py:451-460,
  1009-1037), so nothing is left to redo from unless the train function keeps a host copy
  before every step (as autoaccum's runner does) or does not donate (twice the state).
* e (Gemma3): keras-hub's own ``Task.fit`` maps the preprocessor through ``tf.data``, where
  the offline SentencePiece tokenizer of the project's demo model fails (its resource does
  not exist in the ``tf.data`` graph); autoaccum's ``_preprocess`` runs it per batch eagerly.
  Keras on Keras would lose that path.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import keras
import numpy as np

from autoaccum.adapters.keras._keras_program import find_layout
from autoaccum.adapters.keras._keras_step import keras_train_step
from autoaccum.devices._oom import is_out_of_memory
from autoaccum.planning._micro_batches import UnevenBatches, split_sizes
from autoaccum.training._snapshot import HostSnapshot, is_consumed
from autoaccum.training._step_runner import deferred_interrupts, shrink

EFFECTIVE = 10
EXAMPLES = 25  # 10 + 10 + 5: the epoch's last effective batch is partial
EPOCHS = 2
FEATURES = 8
TOLERANCE = 1e-5

PyTree = Any


# -- the prototype: an accumulated train_function for Keras's own fit -----------------------


def split_in_program(data: PyTree, micro: int) -> PyTree:
    """One step's ``[n, ...]`` arrays (traced) as ``[k, m, ...]`` or :class:`UnevenBatches`."""
    n = int(jax.tree.leaves(data)[0].shape[0])
    steps, last = split_sizes(n, micro)
    width = n if steps == 1 else micro
    if last is None:
        return jax.tree.map(lambda a: a.reshape(steps, width, *a.shape[1:]), data)
    cut = (steps - 1) * micro
    return UnevenBatches(
        full=jax.tree.map(lambda a: a[:cut].reshape(steps - 1, micro, *a.shape[1:]), data),
        last=jax.tree.map(lambda a: a[cut:], data))


class AccumulatedTrainFunction:
    """``model.train_function`` for Keras's JAX ``fit``: one accumulated step per batch.

    ``guard``: hold Ctrl-C from dispatch until the new state is in ``model._jax_state``
    (what Keras's ``finally: jax_state_sync()`` writes back). ``elastic``: after an
    out-of-memory, redo the same batch from the same state at a smaller micro-batch.
    ``backup``: a host copy of the state before every step (for an OOM after donation).
    ``donate``: donate the state, as Keras's own ``make_train_function`` does.
    ``fault(self, phase)``: test hook, called with ``"before"``/``"after"`` the dispatch.
    """

    def __init__(self, model: Any, micro_batch: int, *, guard: bool = True,
                 elastic: bool = True, backup: bool = False, donate: bool = True,
                 fault: Any = None) -> None:
        self.model = model
        self.micro = micro_batch
        self.guard, self.elastic, self.backup, self.donate = guard, elastic, backup, donate
        self.fault = fault
        self.steps = 0
        self.events: list[Any] = []
        self._layout = None
        self._compiled: dict[int, Any] = {}

    def install(self) -> AccumulatedTrainFunction:
        # After compile (which sets train_function = None, trainers/trainer.py:223); Keras's
        # fit then keeps it (make_train_function returns early when one is set).
        self.model.train_function = self
        return self

    def _program(self, micro: int) -> Any:
        if micro not in self._compiled:
            step = keras_train_step(self.model, self._layout)
            layout = self._layout

            def train(state: tuple, data: PyTree) -> tuple:
                trainable, non_trainable, optimizer_vars, metrics_vars = state
                mutable, frozen = layout.split(list(non_trainable))
                new, metrics = step((trainable, mutable, optimizer_vars, metrics_vars),
                                    split_in_program(data, micro), frozen)
                new_trainable, new_mutable, new_optimizer, new_metrics = new
                return metrics.logs, (new_trainable, layout.merge(new_mutable, frozen),
                                      new_optimizer, new_metrics)

            self._compiled[micro] = jax.jit(train, donate_argnums=0 if self.donate else ())
        return self._compiled[micro]

    def __call__(self, state: tuple, iterator: Any) -> tuple:
        # Keras's contract (trainer.py _make_function): steps_per_execution batches per call.
        logs = None
        for i in range(self.model.steps_per_execution):
            try:
                data = next(iterator)
            except StopIteration:
                if i == 0:
                    raise
                break
            logs, state = self._one(state, data)
        return logs, state

    def _one(self, state: tuple, data: PyTree) -> tuple:
        if self._layout is None:
            spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), data)
            self._layout = find_layout(self.model, tuple(spec))
        self.steps += 1
        snapshot = HostSnapshot("host") if self.backup else None
        if snapshot is not None:
            snapshot.take(state)
        n = int(jax.tree.leaves(data)[0].shape[0])
        while True:
            try:
                hold = deferred_interrupts() if self.guard else contextlib.nullcontext()
                with hold:
                    if self.fault:
                        self.fault(self, "before")
                    logs, new_state = self._program(self.micro)(state, data)
                    if self.fault:
                        self.fault(self, "after")
                    if self.guard:  # Keras's finally (jax_state_sync) then writes this state
                        trainable, non_trainable, optimizer_vars, metrics_vars = new_state
                        self.model._jax_state = {
                            "trainable_variables": trainable,
                            "non_trainable_variables": non_trainable,
                            "optimizer_variables": optimizer_vars,
                            "metrics_variables": metrics_vars,
                        }
                return logs, new_state
            except Exception as error:
                if not (self.elastic and is_out_of_memory(error)):
                    raise
                if is_consumed(state):
                    if snapshot is None:
                        raise RuntimeError("state consumed by the failed (donating) step and "
                                           "no host copy to redo it from") from error
                    state = snapshot.restore()
                accum, _ = split_sizes(n, self.micro)
                event = shrink(error, step=self.steps, micro_batch=self.micro,
                               accum_steps=accum, per_device=n)
                self.events.append(event)
                self.micro = event.new_micro_batch


# -- models, data, comparisons --------------------------------------------------------------


def dense_model(optimizer: str, seed: int = 0, steps_per_execution: int = 1) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    opt = (keras.optimizers.SGD(0.05) if optimizer == "SGD"
           else keras.optimizers.AdamW(0.01, weight_decay=0.01))
    model.compile(optimizer=opt, loss="mse", metrics=["mae"],
                  steps_per_execution=steps_per_execution)
    return model


def data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    return x, (x.sum(axis=1, keepdims=True) * 0.3 + rng.normal(size=(n, 1))).astype("float32")


X, Y = data(EXAMPLES, 0)
VAL = data(12, 1)


def weights(model: keras.Model) -> list[np.ndarray]:
    return [np.asarray(w, np.float64) for w in model.get_weights()]


def diff(a: Any, b: Any) -> float:
    wa = weights(a) if isinstance(a, keras.Model) else a
    wb = weights(b) if isinstance(b, keras.Model) else b
    return max(float(np.max(np.abs(p - q))) for p, q in zip(wa, wb, strict=True))


def fit(model: keras.Model, **kwargs: Any) -> Any:
    kwargs = {"batch_size": EFFECTIVE, "epochs": EPOCHS, "shuffle": False, "verbose": 0,
              **kwargs}
    return model.fit(X, Y, **kwargs)


class StopAfter(keras.callbacks.Callback):
    """Stops (``stop_training``) or raises ``error`` after ``steps`` steps in all."""

    def __init__(self, steps: int, error: BaseException | None = None,
                 epoch: int | None = None) -> None:
        super().__init__()
        self.steps, self.error, self.epoch, self.seen = steps, error, epoch, 0
        self.current = 0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current = epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.seen += 1
        if self.epoch is not None:
            if self.current == self.epoch and batch == self.steps - 1:
                raise self.error
            return
        if self.seen == self.steps:
            if self.error is not None:
                raise self.error
            self.model.stop_training = True


def plain_after(optimizer: str, steps: int) -> keras.Model:
    model = dense_model(optimizer)
    fit(model, callbacks=[StopAfter(steps)])
    return model


def state_report(model: keras.Model, reference: keras.Model) -> tuple[str, bool]:
    """The model's weights vs ``reference`` (and its optimizer's step count), or why the
    model holds no usable state."""
    # Diagnosis only (a private name): Keras's fit purges the variables (``_value = None``,
    # trainer.py _purge_model_variables) while an epoch runs; such a variable then reads as
    # its initializer's value instead of raising.
    buffers = [v._value for v in [*model.variables, *model.optimizer.variables]]
    if any(b is None for b in buffers):
        return "weights purged (None)", False
    if any(b.is_deleted() for b in buffers):
        return "weights are deleted (donated) arrays", False
    iterations = int(model.optimizer.iterations)
    d = diff(model, reference)
    ref_iterations = int(reference.optimizer.iterations)
    return (f"diff {d:.1e} vs {ref_iterations} steps, iters {iterations}",
            d < TOLERANCE and iterations == ref_iterations)


ROWS: list[tuple[str, str, str, str]] = []


def row(group: str, name: str, measured: str, ok: bool) -> None:
    ROWS.append((group, name, measured, "holds" if ok else "FAILS"))
    print(f"{group}  {name:<45}{measured:<40}{ROWS[-1][3]}", flush=True)


# -- (a) exactness ---------------------------------------------------------------------------


def exactness() -> None:
    labels = {5: "10=5+5, last 5", 4: "10=4+4+2, last 5=4+1", 3: "10=3+3+3+1, last 5=3+2"}
    for optimizer in ("SGD", "AdamW"):
        plain = dense_model(optimizer)
        expected = fit(plain).history["loss"]
        for micro in (5, 4, 3):
            ours = dense_model(optimizer)
            fn = AccumulatedTrainFunction(ours, micro).install()
            got = fit(ours).history["loss"]
            d = diff(ours, plain)
            loss_d = max(abs(a - b) for a, b in zip(got, expected, strict=True))
            row("a", f"{optimizer:<5} m={micro} ({labels[micro]})",
                f"diff {d:.1e} loss {loss_d:.1e} calls {fn.steps}",
                d < TOLERANCE and loss_d < TOLERANCE and fn.steps == 6
                and int(ours.optimizer.iterations) == 6)
        if optimizer == "AdamW":  # Keras calls train_function once per 2 batches
            ours = dense_model(optimizer, steps_per_execution=2)
            fn = AccumulatedTrainFunction(ours, 4).install()
            fit(ours)
            d = diff(ours, plain)
            row("a", f"{optimizer:<5} m=4, steps_per_execution=2", f"diff {d:.1e} steps {fn.steps}",
                d < TOLERANCE and fn.steps == 6 and int(ours.optimizer.iterations) == 6)
        # Control: the same measure on micro-batches *without* accumulation (plain fit at
        # batch_size=4) must show a difference, or the rows above prove nothing.
        control = dense_model(optimizer)
        fit(control, batch_size=4)
        d = diff(control, plain)
        row("a", f"{optimizer:<5} control: plain fit at batch_size=4",
            f"diff {d:.1e} (must be large)", d > 100 * TOLERANCE)


# -- (b) History, validation, callbacks ------------------------------------------------------


def callbacks_unchanged(tmp: str) -> None:
    plain, ours = dense_model("AdamW"), dense_model("AdamW")
    AccumulatedTrainFunction(ours, 4).install()
    h_plain = fit(plain, validation_data=VAL).history
    h_ours = fit(ours, validation_data=VAL).history
    same_keys = sorted(h_plain) == sorted(h_ours)
    d = max(abs(a - b) for k in h_plain for a, b in zip(h_plain[k], h_ours.get(k, []),
                                                       strict=False))
    row("b", f"History + validation_data, {len(h_ours)} keys",
        f"keys {'equal' if same_keys else 'differ'}, max diff {d:.1e}",
        same_keys and d < TOLERANCE)

    def with_callbacks(model: keras.Model, name: str) -> str:
        path = os.path.join(tmp, f"{name}.weights.h5")
        fit(model, epochs=3, validation_data=VAL, callbacks=[
            keras.callbacks.EarlyStopping("val_loss", patience=1, restore_best_weights=True),
            keras.callbacks.ModelCheckpoint(path, save_weights_only=True, save_freq=2)])
        return path

    plain, ours = dense_model("SGD"), dense_model("SGD")
    AccumulatedTrainFunction(ours, 4).install()
    p_path, o_path = with_callbacks(plain, "plain"), with_callbacks(ours, "ours")
    p_ckpt, o_ckpt = dense_model("SGD"), dense_model("SGD")
    p_ckpt.load_weights(p_path)
    o_ckpt.load_weights(o_path)
    d, dc = diff(ours, plain), diff(o_ckpt, p_ckpt)
    row("b", "EarlyStopping(restore_best)+ModelCheckpoint",
        f"diff {d:.1e}, ckpt diff {dc:.1e}", d < TOLERANCE and dc < TOLERANCE)

    def interrupted_then_resumed(model: keras.Model, name: str, install: bool) -> None:
        backup = keras.callbacks.BackupAndRestore(os.path.join(tmp, f"backup_{name}"))
        if install:
            AccumulatedTrainFunction(model, 4).install()
        with contextlib.suppress(RuntimeError):
            fit(model, callbacks=[backup, StopAfter(2, RuntimeError("node lost"), epoch=1)])
        resumed = dense_model("SGD")  # a fresh process would start from a fresh model
        if install:
            AccumulatedTrainFunction(resumed, 4).install()
        fit(resumed, callbacks=[backup])
        return resumed

    p_res = interrupted_then_resumed(dense_model("SGD"), "plain", False)
    o_res = interrupted_then_resumed(dense_model("SGD"), "ours", True)
    d = diff(o_res, p_res)
    row("b", "BackupAndRestore: fail in epoch 2, resume", f"diff {d:.1e} (vs same on plain)",
        d < TOLERANCE)


# -- (c) interrupts --------------------------------------------------------------------------


def interrupts() -> None:
    reference = plain_after("AdamW", 2)

    ours = dense_model("AdamW")
    AccumulatedTrainFunction(ours, 4).install()
    with contextlib.suppress(KeyboardInterrupt):
        fit(ours, callbacks=[StopAfter(2, KeyboardInterrupt())])
    measured, ok = state_report(ours, reference)
    row("c", "KeyboardInterrupt from a callback, step 2", measured, ok)

    def ctrl_c_in_step_2(fn: AccumulatedTrainFunction, phase: str) -> None:
        if phase == "after" and fn.steps == 2:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C while the dispatched step runs

    plain = dense_model("AdamW")
    plain.make_train_function()  # Keras's own jitted, donating train_function
    inner, calls = plain.train_function, []

    def keras_own(state: tuple, iterator: Any) -> tuple:
        out = inner(state, iterator)
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C while Keras's step 2 runs
        return out

    plain.train_function = keras_own
    try:
        fit(plain)
        measured, ok = "no interrupt reached fit", False
    except KeyboardInterrupt:
        measured, ok = state_report(plain, reference)
    except Exception as error:
        measured, ok = f"fit raised {type(error).__name__}", False
    row("c", "Ctrl-C in step 2, plain Keras fit", measured[:39], ok)

    for guard, name in ((False, "unguarded (Keras's way)"), (True, "guarded + _jax_state set")):
        ours = dense_model("AdamW")
        AccumulatedTrainFunction(ours, 4, guard=guard, fault=ctrl_c_in_step_2).install()
        try:
            fit(ours)
            measured, ok = "no interrupt reached fit", False
        except KeyboardInterrupt:
            measured, ok = state_report(ours, reference)
        except Exception as error:  # Keras's finally (jax_state_sync) failing instead
            measured, ok = f"fit raised {type(error).__name__}", False
        row("c", f"Ctrl-C in step 2, {name}", measured[:39], ok)


# -- (d) elastic recovery --------------------------------------------------------------------


def elastic() -> None:
    reference = dense_model("AdamW")
    fit(reference)

    def oom_once(when: str) -> Any:
        def fault(fn: AccumulatedTrainFunction, phase: str) -> None:
            if phase == when and fn.steps == 1 and not fn.events:
                raise jax.errors.JaxRuntimeError(
                    "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123 bytes.")
        return fault

    cases = [("before", {}, "OOM before dispatch (compile), m 4 -> 2"),
             ("after", {}, "OOM after dispatch, state donated, no copy"),
             ("after", {"backup": True}, "OOM after dispatch, host copy every step"),
             ("after", {"donate": False}, "OOM after dispatch, donation off (2x state)")]
    for when, options, name in cases:
        ours = dense_model("AdamW")
        fn = AccumulatedTrainFunction(ours, 4, fault=oom_once(when), **options).install()
        try:
            fit(ours)
        except Exception as error:  # "state consumed by the failed (donating) step"
            after, _ = state_report(ours, reference)
            row("d", name, f"{type(error).__name__}; {after}"[:39], False)
            continue
        events = [f"m {e.old_micro_batch}->{e.new_micro_batch}" for e in fn.events]
        d = diff(ours, reference)
        row("d", name, f"diff {d:.1e} events {events}",
            d < TOLERANCE and len(events) == 1 and int(ours.optimizer.iterations) == 6)


# -- (e) keras-hub preprocessing -------------------------------------------------------------


TEXTS = ["the cat sat in the hat", "an ant ran", "hello there", "in the end",
         "then the rain", "a hat in hand", "the end of it", "ran and ran"]


def _byte_symbols() -> list[str]:
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = kept[:], 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            symbols.append(256 + extra)
            extra += 1
    return [chr(c) for c in symbols]


def tiny_gpt2(sequence_length: int = 16) -> keras.Model:
    """A 2-layer GPT-2 causal LM with a byte-level BPE tokenizer made here (no download)."""
    import keras_hub

    keras.utils.set_random_seed(0)
    merges = ["Ġ t", "h e", "Ġt he", "i n", "a n", "Ġ a", "Ġ h"]
    vocabulary = {"<|endoftext|>": 0}
    for symbol in _byte_symbols():
        vocabulary[symbol] = len(vocabulary)
    for merge in merges:
        vocabulary[merge.replace(" ", "")] = len(vocabulary)
    tokenizer = keras_hub.tokenizers.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(
        tokenizer, sequence_length=sequence_length)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=len(vocabulary), num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=sequence_length, dropout=0.0)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=preprocessor)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=["accuracy"])
    return model


def keras_hub_preprocessing() -> None:
    try:
        plain, ours = tiny_gpt2(), tiny_gpt2()
    except ImportError as error:
        row("e", "keras-hub GPT2CausalLM on raw strings, m=3", f"skipped: {error}"[:39], False)
        return
    texts = TEXTS * 2  # 16 strings: steps of 8 = 3 + 3 + 2
    expected = plain.fit(texts, batch_size=8, shuffle=False, verbose=0).history["loss"]
    AccumulatedTrainFunction(ours, 3).install()
    got = ours.fit(texts, batch_size=8, shuffle=False, verbose=0).history["loss"]
    d = diff(ours, plain)
    loss_d = abs(got[0] - expected[0])
    row("e", "keras-hub GPT2CausalLM on raw strings, m=3", f"diff {d:.1e} loss diff {loss_d:.1e}",
        d < TOLERANCE and loss_d < TOLERANCE and int(ours.optimizer.iterations) == 2)


def keras_hub_sentencepiece() -> None:
    """The project's own demo model: a tiny Gemma3 whose tokenizer is an offline
    SentencePiece proto. Keras's fit maps its preprocessor through ``tf.data``."""
    name = "keras-hub Gemma3 demo (SentencePiece), m=2"
    try:
        from autoaccum_demo._gemma_demo import build_demo_model, demo_data, load_qa
        raw = demo_data(load_qa()[:8])
        ours = build_demo_model(sequence_length=32)
    except ImportError as error:
        row("e", name, f"skipped: {error}"[:39], False)
        return
    AccumulatedTrainFunction(ours, 2).install()
    try:
        loss = ours.fit(raw, batch_size=8, shuffle=False, verbose=0).history["loss"][0]
    except Exception as error:  # raised by Keras's data pipeline, before any step runs
        origin = "tf.data" if "Dataset" in str(error) else "fit"
        row("e", name, f"{type(error).__name__} in {origin}", False)
        return
    row("e", name, f"loss {loss:.3f}", bool(np.isfinite(loss)))


def main() -> None:
    start = time.perf_counter()
    print(f"{'row':<48}{'measured':<40}verdict")
    exactness()
    with tempfile.TemporaryDirectory() as tmp:
        callbacks_unchanged(tmp)
    interrupts()
    elastic()
    keras_hub_preprocessing()
    keras_hub_sentencepiece()
    held = sum(r[3] == "holds" for r in ROWS)
    print(f"{held}/{len(ROWS)} rows hold; {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
