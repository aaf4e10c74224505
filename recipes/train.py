"""Train a recipe. Works under any launcher, on GPUs (nccl) or CPUs (gloo):

    deepspeed --num_gpus 2 recipes/train.py --recipe tiny_zero3
    torchrun --nproc_per_node 2 recipes/train.py --recipe tiny_zero3 --set training.steps=50
    python recipes/train.py --recipe tiny_zero0          # one process
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from toolkit.errors import ToolkitError  # noqa: E402
from toolkit.recipe import load_recipe  # noqa: E402


def _leave(code: int) -> int:
    """The exit code of a rank that stops on a ToolkitError. Under a process group of several ranks it exits at once,
    skipping the interpreter's teardown: that ran while gloo's threads were alive and intermittently aborted the rank
    after its line was printed (SIGABRT, "terminate called without an active exception", a trial of 2026-12-07).
    Leaving the group first could wait on a collective that a rank which did not fail never joins."""
    dist = sys.modules.get("torch.distributed")  # no torch imported yet (a recipe error): no process group
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from toolkit.metrics import close_all

        close_all()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _says(error: ToolkitError) -> bool:
    """Whether this rank prints its refusal. Before the process group exists, the ranks of a node check the same
    recipe and files and refuse alike: the node's first rank says it for all (every rank printed it until 2026-12-07,
    eight copies per node on GPUs). Once they have joined, rank 0 says a refusal that every rank makes alike (the
    recipe against the world size), and each rank its own."""
    dist = sys.modules.get("torch.distributed")
    if not (dist is not None and dist.is_available() and dist.is_initialized()):
        return os.environ.get("LOCAL_RANK", "0") == "0"
    return not getattr(error, "alike_on_every_rank", False) or dist.get_rank() == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", required=True, help="shipped recipe name or path to a YAML recipe")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a recipe key (repeatable)")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # from launchers
    args = ap.parse_args()
    from toolkit.train.preempt import Preempted, finished, watch_early

    watch_early()  # a time-limit warning during start-up is kept for the first step boundary

    try:
        from toolkit.run import train

        train(load_recipe(args.recipe, args.overrides))
        finished()
    except ToolkitError as e:
        if _says(e):  # one write: print's second one (the newline) let another rank's line join this one's last
            sys.stderr.write(f"error: {e}\n")
            sys.stderr.flush()
        return _leave(e.exit_code)
    except Preempted as e:  # checkpoint complete; <output_dir>/preempted.json tells the job script to requeue
        # every rank stops with it at the same step and rank 0's log has it: one line per job, not one per rank
        # (3 lines for 2 ranks until 2026-12-07)
        finished()
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
