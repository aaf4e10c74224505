"""Build DeepSpeed's JIT ops into this environment's extensions cache while the suite runs.

conftest.py starts this in the background when slow tests are selected: on a fresh machine the ops take
about 11 CPU-minutes to compile (docs/testing.md), and a test that needs one only finds it built, or waits on torch's build lock
for the rest, instead of compiling it in its own time. Killed with SIGTERM, it stops through torch's `finally`, so
no abandoned lock is left behind.
"""
import signal
import sys

OPS = ("ShareMemCommBuilder", "CPUAdamBuilder", "PinMemoryBuilder", "AsyncIOBuilder")  # in the order tests use them


def _stop(*_):
    raise SystemExit(1)


def main() -> int:
    signal.signal(signal.SIGTERM, _stop)
    from deepspeed.accelerator import get_accelerator  # lazy: after the handler, so a stop during import is clean

    for name in OPS:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"build_ops: {name} cannot be built here, left to the test that needs it", file=sys.stderr)
            continue
        builder.load(verbose=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
