"""scripts/boundaries_experiment.py's dataflow kernel (one launch, phases waiting on counters)
computes the same chain as separate launches of the engine's fused kernel; its counters are zero
again after a launch. On CPU Triton's interpreter runs programs in index order, so no wait ever
waits. (The experiment is not part of pagedlab; this keeps the script working as the kernels
change.)"""
import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "boundaries_experiment.py"
_spec = importlib.util.spec_from_file_location("boundaries_experiment", SCRIPT)
experiment = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(experiment)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("d,n,block_r,block_k,preload", [(64, 3, 8, 32, False), (100, 4, 16, 64, True),
                                                         (48, 1, 8, 16, True)])
def test_dataflow_chain_equals_separate_launches(d, n, block_r, block_k, preload):
    g = torch.Generator().manual_seed(d)
    w = (torch.randn(n, d, d, generator=g) * d ** -0.5).to(DEV)
    x0 = torch.randn(d, generator=g).to(DEV)
    ref = x0.double()
    for k in range(n):
        ref = ref + w[k].double() @ ref
    state = None
    for _ in range(2):                   # the second launch reuses the counters of the first
        state = experiment.dataflow_chain(x0, w, block_r=block_r, block_k=block_k, preload=preload,
                                          state=state)
        x, done, err = state
        assert ((x[n].double() - ref).norm() / ref.norm()).item() < 1e-5
        assert done.tolist() == [0] * n and err.item() == 0
    for mode in ("off", "late"):
        sep = experiment.separate_chain(x0, w, mode)
        assert ((sep.double() - ref).norm() / ref.norm()).item() < 1e-5
