"""On a GPU: the overlap loop (CUDA graphs, the host one step ahead) under SIGINTs at random
moments, as tests/test_interrupts.py does on the CPU with graphs emulated: every request handed out
once, every block back, outputs equal a clean engine's, and the next run is clean."""
import pytest
import torch

from helpers import tiny_llm
from test_interrupts import SigintTimer, make_stream, outputs, plain_step, run_stream, run_with_sigints

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def gpu_engine(caching: bool):
    llm = tiny_llm(device="cuda", dtype="float32", max_num_seqs=3, block_size=4, num_blocks=24,
                   max_num_batched_tokens=20, prefix_caching=caching)
    assert llm.engine.overlap, "the GPU engine should run the overlap loop"
    return llm.engine


@pytest.mark.parametrize("caching", [False, True])
def test_overlap_loop_interrupted_at_random_moments(caching):
    clean, eng = gpu_engine(caching), gpu_engine(caching)
    everyone, caught, rounds = [], 0, 0
    while rounds < 2 or caught < 40:
        stream = make_stream(70 + rounds, caching)
        want = outputs(run_stream(clean, stream, plain_step))
        done, n = run_with_sigints(eng, stream, SigintTimer(seed=rounds, max_delay_s=0.003), everyone)
        assert outputs(done) == want
        caught += n
        rounds += 1
    assert outputs(run_stream(eng, stream, plain_step, everyone)) == want
    assert eng.num_overlapped > 0, "no step ran ahead: the overlap loop was not exercised"
