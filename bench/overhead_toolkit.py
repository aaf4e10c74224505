"""recipes/train.py, unchanged, with bench/overhead.py's step clock ticking at the start of every step.

    torchrun --nproc_per_node 2 bench/overhead_toolkit.py --times times.json -- --recipe tiny_zero3 --set ...

The clock ticks when the training loop asks the toolkit's DataStream for the step's batches, which is where the
hand-written scripts tick too (right before they fetch theirs); nothing else of the toolkit is touched.
"""
import os
import runpy
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))
from overhead_clock import StepClock  # noqa: E402


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 3 or args[0] != "--times" or args[2] != "--":
        raise SystemExit("usage: overhead_toolkit.py --times FILE -- RECIPES/TRAIN.PY ARGS")
    times, clock = args[1], StepClock()
    from toolkit.data import DataStream

    fetch = DataStream.next_step

    def next_step(self):
        clock.tick()
        return fetch(self)

    DataStream.next_step = next_step
    sys.argv = [str(BENCH.parent / "recipes" / "train.py"), *args[3:]]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:  # train.py ends with sys.exit(main())
        code = e.code or 0
    clock.save(times)
    # train.py has returned (and left the process group): skip the interpreter's teardown, which intermittently
    # aborts a rank after the work is done ("terminate called without an active exception" from a library
    # thread) and is not what is timed; train.py's own exit code is kept
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)


if __name__ == "__main__":
    main()
