"""Test-runner levers for ``make test``, measured side by side: the same pytest run (a subset of
the suite, ``-n 2 --dist loadgroup`` as ``make test``) in each configuration, configurations
interleaved round by round (this machine's speed drifts by 20% within a day, so only runs made
next to each other compare). Prints each run's wall and CPU seconds (the run and every process
it started) and, per configuration, its mean against the baseline's.

Configurations:
  baseline: ``make test``'s own settings.
  pinned: each xdist worker (and every process it starts) pinned to its own share of the
    cores (``benchmarks/_pin_workers.py``, a pytest plugin), so XLA sizes its thread pools to
    that share.
  no-jax-cache: JAX's persistent compilation cache off (``JAX_ENABLE_COMPILATION_CACHE``).

    .venv/bin/python benchmarks/runner_levers.py --rounds 2 pinned
    .venv/bin/python benchmarks/runner_levers.py --test tests/adapters/keras/test_uneven.py \
        pinned no-jax-cache

Measured 2026-11-26 on the 2-core machine, the default subset (254 tests: the Flax adapter,
``tests/training`` with its 4- and 8-device children, backoff, Keras uneven), wall / CPU s:

    pinned:       round 1 313.5 / 612.7, round 2 289.9 / 566.1
    baseline:     round 1 334.7 / 641.7, round 2 313.2 / 606.7   (pinned: 0.93x wall, 0.94x CPU)
    no-jax-cache: round 1 303.6 / 586.2, round 2 313.1 / 606.2
    baseline:     round 1 308.8 / 603.1, round 2 298.8 / 574.1   (within the noise)

One module whose tests all run in one child process with 4 host devices
(``--test tests/adapters/keras/test_keras_train_step.py``, 15 tests), one round at 22:22:
pinned 68.4 s / 71.0 CPU s, baseline 90.6 / 94.4 (0.75x).

The whole suite (``make test``) the same evening, pinned and unpinned in turn: pinned 20 min 2 s
(2356 CPU s, started 21:35), unpinned 18 min 6 s (2131, 21:57), pinned 14 min 59 s (1771,
22:27), unpinned 18 min 42 s (2190, 22:46). The machine's speed moved by more than the lever
within the hour, so whole-suite runs decide it only over several interleaved rounds
(``--test all --rounds 3``, about 100 minutes).
2026-11-27: unpinned 18 min 57 s (2213 CPU s, ``make test`` started 23:36), then pinned
(``--test all``, 23:56) 19 min 58 s (2304 CPU s) with one test failed (which, this script did
not keep then; it prints the failures now). Of the whole-suite runs, pinned: 20:02, 14:59,
19:58; unpinned: 18:06, 18:42, 18:57. ``make test`` does not pin: the gains measured side by
side on a subset do not carry to the whole suite, where a pinned worker cannot use the other
core while its partner waits (on a child, or at the end of the queue).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from _common import children_cpu_seconds, print_table

REPO = Path(__file__).resolve().parent.parent
SUBSET = ["tests/adapters/flax", "tests/training", "tests/planning/test_backoff.py",
          "tests/adapters/keras/test_uneven.py"]
CONFIGURATIONS: dict[str, tuple[list[str], dict[str, str]]] = {
    "baseline": ([], {}),
    "pinned": (["-p", "_pin_workers"], {}),
    "no-jax-cache": ([], {"JAX_ENABLE_COMPILATION_CACHE": "false"}),
}
"""Each configuration's extra pytest arguments and environment."""


def run_once(tests: list[str], name: str) -> tuple[float, float, str]:
    """Wall and CPU seconds of one pytest run in configuration ``name``, and its last line."""
    extra, env = CONFIGURATIONS[name]
    environment = {**os.environ, **env,
                   "PYTHONPATH": os.pathsep.join([str(REPO / "benchmarks"), str(REPO)])}
    before = children_cpu_seconds()
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist",
                           "loadgroup", "-p", "no:cacheprovider", "-rf", *extra, *tests],
                          cwd=REPO, env=environment, capture_output=True, text=True)
    wall = time.perf_counter() - start
    cpu = children_cpu_seconds() - before
    lines = proc.stdout.strip().splitlines()
    for line in lines:
        if line.startswith(("FAILED ", "ERROR ")):
            print(f"{name}: {line}", file=sys.stderr, flush=True)
    return wall, cpu, lines[-1] if lines else f"exit {proc.returncode}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configurations", nargs="+", choices=sorted(CONFIGURATIONS),
                        help="compared with the baseline, each run next to it")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--test", action="append", dest="tests",
                        help="a test path (repeat it for several; default: the subset above); "
                        "'all': the whole suite as make test runs it (its testpaths, the "
                        "session's background jobs started with it)")
    args = parser.parse_args()
    args.tests = [] if args.tests == ["all"] else args.tests or SUBSET
    names = [n for n in args.configurations if n != "baseline"] + ["baseline"]
    rows, totals = [], {n: [0.0, 0.0] for n in names}
    for round_ in range(1, args.rounds + 1):
        for name in names:
            wall, cpu, last = run_once(args.tests, name)
            totals[name][0] += wall
            totals[name][1] += cpu
            rows.append([round_, name, time.strftime("%H:%M"), f"{wall:.1f}", f"{cpu:.1f}",
                         last])
            print(f"round {round_} {name}: {wall:.1f} s wall, {cpu:.1f} CPU s ({last})",
                  file=sys.stderr, flush=True)
    print_table(["round", "configuration", "ended", "wall s", "CPU s", "pytest"], rows)
    base_wall, base_cpu = totals["baseline"]
    print()
    print_table(["configuration", "wall vs baseline", "CPU vs baseline"],
                [[n, f"{w / base_wall:.2f}x", f"{c / base_cpu:.2f}x"]
                 for n, (w, c) in totals.items()])


if __name__ == "__main__":
    main()
