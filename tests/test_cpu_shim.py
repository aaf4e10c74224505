"""toolkit/megatron/cpu_shim.py refuses to install when CUDA is available, and then patches nothing.

The check runs in a fresh Python process, so that a shim that did patch could not leak into this one. There CUDA
is faked as available (torch.cuda.is_available -> True) and install() must raise its message while every
attribute of torch, torch.cuda, torch.cuda.random, torch.Tensor and Megatron's tensor_parallel.random stays the
very same object, no torch function mode is pushed and device="cuda" is not redirected. As a control, the same
child then installs the shim for real (CUDA faked as unavailable) and the same snapshot must see the patches: the
comparison is able to fail.
"""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO

CHILD = r'''
import json
import torch
import megatron.core.tensor_parallel.random as mrandom
from toolkit.megatron import cpu_shim

MODULES = {"torch": torch, "torch.cuda": torch.cuda, "torch.cuda.random": torch.cuda.random,
           "torch.Tensor": torch.Tensor, "megatron.core.tensor_parallel.random": mrandom}


def snapshot():
    return {name: dict(vars(m)) for name, m in MODULES.items()}


def changed(before, after):
    """Names whose object is not the very same one (patched, added or removed)."""
    out = []
    for name in MODULES:
        a, b = before[name], after[name]
        out += [f"{name}.{k}" for k in sorted(set(a) | set(b)) if a.get(k, a) is not b.get(k, b)]
    return out


def modes():
    return len(torch.overrides._get_current_function_mode_stack())


def cuda_factory_device():
    try:
        return torch.zeros(1, device="cuda").device.type
    except Exception as e:  # no CUDA here: torch refuses, as it must when nothing is redirected
        return "refused: " + type(e).__name__


report = {"cuda_really_available": torch.cuda.is_available()}
real_is_available = torch.cuda.is_available
before, modes_before = snapshot(), modes()
torch.cuda.is_available = lambda: True  # a machine with a GPU
errors = []
for _ in range(2):  # a refused install must not leave it half-installed (a second call refuses again)
    try:
        cpu_shim.install()
        errors.append(None)
    except Exception as e:
        errors.append([type(e).__name__, str(e)])
torch.cuda.is_available = real_is_available
after = snapshot()
report.update(errors=errors, changed_after_refusal=changed(before, after), modes_pushed=modes() - modes_before,
              cuda_factory_after_refusal=cuda_factory_device())

# control: without CUDA (faked too, so that this holds on a GPU machine) the shim installs, and the same snapshot
# sees it
torch.cuda.is_available = lambda: False
cpu_shim.install()
report.update(changed_after_install=changed(before, snapshot()), modes_pushed_by_install=modes() - modes_before,
              cuda_factory_after_install=cuda_factory_device())
print("REPORT " + json.dumps(report))
'''


def test_install_refuses_when_cuda_is_available_and_patches_nothing():
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.split("REPORT ", 1)[1])
    msg = ["RuntimeError", "the Megatron CPU shim must not be installed on a machine with a GPU"]
    assert report["errors"] == [msg, msg]
    assert report["changed_after_refusal"] == []
    assert report["modes_pushed"] == 0
    # device="cuda" is not redirected: torch refuses it here (no CUDA), or makes a CUDA tensor on a GPU machine
    want = "cuda" if report["cuda_really_available"] else "refused: "
    assert report["cuda_factory_after_refusal"].startswith(want)
    # the control: a real install is visible to the very same comparison
    changed = set(report["changed_after_install"])
    for name in ("torch.cuda.current_device", "torch.cuda.synchronize", "torch.cuda.device_count",
                 "torch.cuda.get_rng_state", "torch.cuda.set_rng_state", "torch.cuda.manual_seed",
                 "torch.cuda.random.get_rng_state", "torch.zeros", "torch.empty",
                 "megatron.core.tensor_parallel.random._get_cuda_rng_state"):
        assert name in changed, (name, sorted(changed))
    assert report["modes_pushed_by_install"] == 1
    assert report["cuda_factory_after_install"] == "cpu"
