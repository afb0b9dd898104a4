"""The throughput objective: deterministic choice among measured candidates."""

import collections

import jax
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.planning import _cache
from autoaccum.planning._plan_options import Candidate, choose_fastest, cost_model_seconds
from tests._models import TinyLM, ragged_tokens, token_loss


def _c(remat, micro, seconds):
    return Candidate(remat, micro, 16 // micro, micro * 100, seconds, "measured")


def test_fastest_candidate_wins_when_clearly_faster():
    assert choose_fastest([_c("none", 8, 1.0), _c("none", 4, 0.7), _c("none", 2, 0.9)]) == \
        _c("none", 4, 0.7)


def test_within_tolerance_the_fewest_micro_steps_win():
    # 4 x 4 timed 1% faster than the whole batch: within timing noise, the whole batch.
    chosen = choose_fastest([_c("none", 16, 1.00), _c("none", 8, 1.04), _c("none", 4, 0.99)])
    assert chosen.micro_batch == 16
    # Outside the tolerance, the fastest.
    assert choose_fastest([_c("none", 16, 1.00), _c("none", 4, 0.90)]).micro_batch == 4


def test_ties_prefer_less_recompute_and_ignore_input_order():
    cands = [_c("nothing", 8, 1.0), _c("dots", 8, 1.0), _c("none", 8, 1.01)]
    for order in (cands, cands[::-1]):
        assert choose_fastest(order).remat == "none"


def test_tolerance_zero_takes_the_strict_fastest():
    assert choose_fastest([_c("none", 16, 1.0), _c("none", 8, 1.04)], tolerance=0).micro_batch \
        == 16


def test_no_candidates_is_an_error():
    with pytest.raises(ValueError):
        choose_fastest([])


def test_cost_model_uses_the_roofline_of_the_profile():
    t4 = autoaccum.devices.find_profile("t4")
    assert cost_model_seconds(8.1e12, 1.0, t4, 2) == pytest.approx(0.5, rel=0.01)
    assert cost_model_seconds(1.0, 320e9, t4, 1) == pytest.approx(1.0, rel=0.01)  # bandwidth


@pytest.mark.slow
def test_throughput_plan_times_candidates_and_picks_by_the_rule(monkeypatch):
    options = []  # the timed candidates run: no probe is compiled for its memory alone
    compile_ = jax.stages.Lowered.compile

    def recording(self, *args, **kwargs):
        options.append(kwargs.get("compiler_options") or {})
        return compile_(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", recording)
    model = TinyLM(rngs=nnx.Rngs(0))
    plan = autoaccum.plan(model, ragged_tokens(32, 12), effective_batch=16, budget="1GiB",
                          optimizer=optax.sgd(0.1), loss_fn=token_loss, log=None,
                          search=autoaccum.Search(objective="throughput", cache=False))
    assert len(options) >= 2 and all("xla_backend_optimization_level" not in o
                                     for o in options)
    assert plan.objective == "throughput"
    assert len(plan.candidates) >= 2
    assert all(c.source == "measured" and c.seconds_per_example > 0 for c in plan.candidates)
    best = choose_fastest(plan.candidates)
    assert (plan.remat, plan.micro_batch) == (best.remat, best.micro_batch)
    assert plan.micro_batch * plan.accum_steps == 16
    assert plan.estimate.micro_batch == plan.micro_batch  # the need of the chosen split
    assert "<- chosen" in plan.report()


def test_throughput_times_the_planners_kept_step_without_compiling_it_again(monkeypatch):
    # Under 1 GiB the search compiles the whole batch of 16 once, kept; the candidates timed
    # are 16, 8 and 6 (6 + 6 + 4: the smallest micro-batch taking 3 steps, as the search's
    # candidates): 16 runs the kept step (on a copy of the state), 8 and 6 are compiled,
    # donating, and kept for the training loop. Three step compiles, where timing compiled
    # 16 again (five, with a probe at 2 before).
    compiles = []
    compile_ = jax.stages.Lowered.compile

    def counting(self, *args, **kwargs):
        if len(self.as_text()) > 20000:  # a train step, not a small helper program
            compiles.append(self)
        return compile_(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", counting)
    monkeypatch.setattr(_cache, "_KEPT", collections.OrderedDict())  # none kept by others
    plan = autoaccum.plan(TinyLM(rngs=nnx.Rngs(0)), ragged_tokens(32, 12), effective_batch=16,
                          budget="1GiB", optimizer=optax.sgd(0.1), loss_fn=token_loss, log=None,
                          search=autoaccum.Search(objective="throughput", cache=False))
    assert sorted(c.micro_batch for c in plan.candidates) == [6, 8, 16]
    assert len(compiles) == 3


def test_a_throughput_choice_other_than_the_searchs_drops_its_notes_on_that_split(
        monkeypatch):
    # The search takes the whole batch of 16 and verifies it by a real step; the timing
    # (made to) choose 6 + 6 + 4: the plan's notes speak of it, not of 16 x 1.
    from autoaccum.planning import _plan_model

    def slowest_is_fastest(candidates, **_):
        return min(candidates, key=lambda c: c.micro_batch)

    monkeypatch.setattr(_plan_model, "choose_fastest", slowest_is_fastest)
    plan = autoaccum.plan(TinyLM(rngs=nnx.Rngs(0)), ragged_tokens(32, 12), effective_batch=16,
                          budget="1GiB", optimizer=optax.sgd(0.1), loss_fn=token_loss, log=None,
                          search=autoaccum.Search(objective="throughput", cache=False))
    assert (plan.micro_batch, plan.accum_steps, plan.last_micro_batch) == (6, 3, 4)
    assert not any("16 x 1" in note or "micro_batch=16" in note for note in plan.notes)
    assert "verified by real steps at micro_batch=6 x 3 (last 4) (timed)" in plan.notes


def test_throughput_tries_no_remat_policy_once_the_whole_batch_fits_in_one_step():
    # A model with blocks to checkpoint, whose whole batch of 8 fits 1 GiB without remat: a
    # policy recomputes more for a larger micro-batch, and there is none to gain. Every
    # policy was planned, compiled and timed before (tiny steps on a CPU timed "dots" the
    # fastest, by noise).
    from tests.planning.test_depth import DeepLM

    plan = autoaccum.plan(DeepLM(2, dim=16, rngs=nnx.Rngs(0)), ragged_tokens(16, 9, vocab=256),
                          effective_batch=8, budget="1GiB", optimizer=optax.sgd(0.1),
                          loss_fn=token_loss, log=None,
                          search=autoaccum.Search(objective="throughput", cache=False))
    assert {c.remat for c in plan.candidates} == {"none"} and plan.remat == "none"
    assert {p.remat for p in plan.probes} == {"none"}


def test_unknown_objective_names_both():
    with pytest.raises(ValueError, match="'memory'.*'throughput'"):
        autoaccum.plan(TinyLM(rngs=nnx.Rngs(0)), ragged_tokens(32, 12), effective_batch=16,
                       optimizer=optax.sgd(0.1), loss_fn=token_loss,
                       log=None, search=autoaccum.Search(objective="speed"))


@pytest.mark.slow
def test_dry_run_throughput_plan_uses_the_cost_model():
    model = TinyLM(rngs=nnx.Rngs(0))
    plan = autoaccum.plan(model, ragged_tokens(32, 12), effective_batch=16, device="t4",
                          optimizer=optax.sgd(0.1), loss_fn=token_loss,
                          log=None, search=autoaccum.Search(objective="throughput"))
    assert plan.candidates and all(c.source == "cost model" for c in plan.candidates)
    assert plan.to_dict()["objective"] == "throughput"


def test_throughput_times_uneven_splits_where_the_batch_has_few_divisors(monkeypatch):
    # Effective batch 13 (prime) with room for 7: the search plans 7 + 6. Its divisors below
    # 7 are only 1, so timing them alone chose 1 x 13, thirteen micro-steps. Now the timed
    # candidates are the search's own: 7 + 6, 5 + 5 + 3 and 4 + 4 + 4 + 1, each run as the
    # uneven step it is, and 1 x 13 is not among them.
    from autoaccum.planning import _plan_options

    timed = []
    original = _plan_options.time_real_steps

    def recording(run, micro, accum, **kwargs):
        timed.append((micro, accum, kwargs.get("last")))
        return original(run, micro, accum, **kwargs)

    monkeypatch.setattr(_plan_options, "time_real_steps", recording)
    plan = autoaccum.plan(TinyLM(256, 64, 128, rngs=nnx.Rngs(0)),
                          ragged_tokens(32, 32, vocab=256), effective_batch=13,
                          budget="2300KiB", optimizer=optax.adamw, learning_rate=1e-3,
                          loss_fn=token_loss, log=None,
                          search=autoaccum.Search(objective="throughput",
                                                            cache=False))
    assert sorted(timed) == [(4, 4, 1), (5, 3, 3), (7, 2, 6)]
    assert sorted((c.micro_batch, c.accum_steps, c.last_micro_batch)
                  for c in plan.candidates) == sorted(timed)
    assert plan.micro_batch in (4, 5, 7)
    assert plan.last_micro_batch == {4: 1, 5: 3, 7: 6}[plan.micro_batch]
    assert "(last " in plan.report()


def test_throughput_never_chooses_a_timed_split_over_the_budget(monkeypatch):
    # The fastest timed split's compiled need is over the budget: a slower one under it is
    # chosen (the timing compiles splits the search did not).
    from autoaccum.planning import _plan_model
    from autoaccum.planning._plan_options import Candidate

    def timed(tried, *args, **kwargs):
        budget = tried[0].budget_bytes
        return [Candidate("none", 16, 1, budget + 1, 1.0, "measured"),
                Candidate("none", 8, 2, budget - 1, 2.0, "measured")]

    monkeypatch.setattr(_plan_model, "_candidates", timed)
    plan = autoaccum.plan(TinyLM(rngs=nnx.Rngs(0)), ragged_tokens(32, 12), effective_batch=16,
                          budget="1GiB", optimizer=optax.sgd(0.1), loss_fn=token_loss, log=None,
                          search=autoaccum.Search(objective="throughput", cache=False))
    assert (plan.micro_batch, plan.accum_steps) == (8, 2)
