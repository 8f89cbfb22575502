"""pytest -p pytest_cuda_failfast (PYTHONPATH=.ci): a test that raises a CUDA error (an illegal
address, a device-side assert) has it printed AT ONCE, and the run ends there.

Why: after such an error the CUDA context is dead. pytest would go on formatting the failure, and
the garbage collector it runs meanwhile frees tensors whose destructors call CUDA -- which aborts the
process ("Fatal Python error: Aborted") before the failure or even the test's name is printed
(.ci/gpu gpu-suite, session 16). Other failures are left to pytest as usual."""
import os
import sys
import time
import traceback

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    t0 = time.time()
    outcome = yield
    if outcome.excinfo is None:
        return
    et, ev, tb = outcome.excinfo
    text = f"{et.__name__}: {ev}"
    if "CUDA error" in text or et.__name__ in ("AcceleratorError", "CudaError"):
        capture = item.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.suspend_global_capture(in_=True)     # (what the test printed is not lost either)
            out, err = capture.read_global_capture()
            sys.stdout.write(out[-4000:])
            sys.stderr.write(err[-4000:])
        sys.stdout.write(f"\n{item.nodeid} raised a CUDA error after {time.time() - t0:.1f} s; the CUDA "
                         "context is gone, so the run stops here:\n")
        sys.stdout.write("".join(traceback.format_exception(et, ev, tb))[-8000:])
        sys.stdout.flush()
        os._exit(3)
