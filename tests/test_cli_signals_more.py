"""More of test_cli_signals.py: a max_model_len past the model's own limit (refused before anything
of its size is built), `serve --api-servers 2` with a bad model (one line, as one front end says
it), the front ends' open streams ended with the shutdown's error event, and child processes
(front ends, tensor-parallel workers) that begin with SIGINT ignored; a worker whose rank 0 dies
during setup exits at once.

Every process started here is SIGKILLed at the end, pass or fail (the `procs` fixture of
test_cli_signals.py; the in-process servers' stop() in a finally)."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pagedlab import LLM
from pagedlab.validation import ValidationError
from test_cli_signals import (MODEL, ROOT, assert_ended_with_an_error_event, free_port, one_line_error,  # noqa: F401
                              procs, run_main, serving, session_left,
                              streams_open_at_a_stopped_core)


def sigint_ignored_in(pid: int) -> bool:
    """Does process `pid` ignore SIGINT (its SigIgn mask, /proc)?"""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(mask & (1 << (signal.SIGINT - 1)))


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- 1. max_model_len past the model's limit ------------------------------------------------------

def test_max_model_len_past_the_models_limit_is_refused_before_anything_big():
    """999999999 on random:tiny (max_position_embeddings 256) built a RoPE table of 999999999 rows:
    "can't allocate memory", a traceback. Now a ValueError naming max_model_len and the limit,
    at once; the limit itself is still allowed."""
    t0 = time.monotonic()
    with pytest.raises(ValidationError) as e:
        LLM(MODEL, device="cpu", max_model_len=999999999, show_progress=False)
    assert time.monotonic() - t0 < 10
    msg = str(e.value)
    assert e.value.field == "max_model_len" and "max_model_len" in msg and "256" in msg and "999999999" in msg, msg
    assert isinstance(e.value, ValueError)
    assert LLM(MODEL, device="cpu", max_model_len=256, show_progress=False).engine.max_model_len <= 256


def test_max_model_len_past_the_models_limit_is_one_line_in_the_cli(capsys):
    code, err = run_main(["generate", "--model", MODEL, "--device", "cpu", "--max-model-len", "999999999", "hi"],
                         capsys)
    line = one_line_error(err)
    assert code == 2 and line.startswith("error: --max-model-len: max_model_len must be at most 256"), err
    # serve: refused in the engine core's process, said here (CoreStartError carries it)
    code, err = run_main(["serve", "--model", MODEL, "--device", "cpu", "--port", str(free_port()),
                          "--max-model-len", "999999999"], capsys)
    line = one_line_error(err)
    assert code == 2 and line.startswith("error: --max-model-len: max_model_len must be at most 256"), err


# -- 2. serve --api-servers 2 ---------------------------------------------------------------------

def test_api_servers_with_a_bad_model_raise_the_cores_error_and_start_children_sigint_ignored():
    """The front ends sent only str(CoreStartError): the parent raised a RuntimeError holding the
    core's traceback (the CLI printed it). Now the CoreStartError itself, its .error the core's
    ModelNotFound. The front ends are started with SIGINT ignored (a Ctrl-C while they import
    printed KeyboardInterrupt tracebacks): their mask says so before they could set it themselves."""
    from pagedlab.core_process import CoreStartError
    from pagedlab.server.frontends import FrontEnds
    from pagedlab.weights import ModelNotFound
    fronts = FrontEnds("random:nope", "nope", "127.0.0.1", 0, 8, "warning", 2, device="cpu")
    pids = fronts.frontend_pids + fronts.core_pids
    try:
        ignored = {pid: sigint_ignored_in(pid) for pid in pids}    # at once: they are still importing
        with pytest.raises(CoreStartError) as e:
            fronts.wait_ready(timeout=60)
        assert isinstance(e.value.error, ModelNotFound), repr(e.value.error)
        assert all(ignored.values()), ignored
    finally:
        fronts.stop(timeout=10)
        kill_all(pids)
    assert not any(p.is_alive() for p, _ in fronts.frontends)


def test_ctrl_c_ends_the_front_ends_open_streams_with_an_error_event(procs):
    """As test_cli_signals' one-front-end case: with --api-servers 2 the front ends ran uvicorn's
    plain server, which cut open streams mid-body once its 5 s grace ran out. Now run.Server's
    (graceful.py): each stream ends with the shutdown's error event and [DONE]."""
    p, url, core = serving(procs, "--api-servers", "2")
    threads, events = streams_open_at_a_stopped_core(url, 2, core)    # they outlast the grace
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGINT)
    for t in threads:
        t.join(15)
    took = time.monotonic() - t0
    os.kill(core, signal.SIGCONT)
    assert p.wait(30) == 130
    out = p.stdout.read()
    assert_ended_with_an_error_event(events)
    assert took < 8, took
    assert "Traceback" not in out and out.strip().endswith("interrupted"), out
    time.sleep(0.5)
    assert not session_left(p.pid)


# -- 3. tensor-parallel workers -------------------------------------------------------------------

def test_workers_start_with_sigint_ignored():
    """Workers set SIGINT ignored in worker_main, after importing torch and pagedlab (seconds): a
    Ctrl-C then printed a KeyboardInterrupt traceback per worker. Now they begin with it ignored."""
    from pagedlab import tiny_config
    from pagedlab.config import EngineConfig
    from pagedlab.parallel import workers as ranks
    spec = ranks.WorldSpec(2, 1, "cpu", "float32", tiny_config(), EngineConfig(), "torch", None, {})
    w = ranks.Workers(spec)
    try:
        assert sigint_ignored_in(w.procs[0].pid)
    finally:
        w.shutdown()
        kill_all([p.pid for p in w.procs])


ORPHAN = textwrap.dedent("""
    import time
    from pagedlab.parallel import workers as ranks
    started = ranks.Workers.__init__
    def init(self, spec):
        started(self, spec)
        print("workers", *[p.pid for p in self.procs], flush=True)
    def setup_hangs(rank, spec):         # rank 0 never joins: the workers wait in init_world
        print("hanging", flush=True)
        time.sleep(600)
    ranks.Workers.__init__, ranks.init_world = init, setup_hangs
    from pagedlab import LLM
    LLM("random:tiny", device="cpu", tensor_parallel_size=2, show_progress=False)
""")


def test_a_worker_whose_rank_0_dies_during_setup_exits():
    """Rank 0 SIGKILLed while the world forms: its worker waited out torch.distributed's 10-minute
    setup timeout in init_world. Now it sees its parent gone and exits within a second or two."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-c", ORPHAN], cwd=ROOT, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    workers = []
    try:
        for line in p.stdout:
            if line.startswith("workers"):
                workers = [int(x) for x in line.split()[1:]]
            if line.startswith("hanging"):
                break
        assert workers, p.stdout.read()
        time.sleep(0.3)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        end = time.monotonic() + 8
        while time.monotonic() < end and any(os.path.exists(f"/proc/{w}") and not zombie(w) for w in workers):
            time.sleep(0.1)
        left = [w for w in workers if os.path.exists(f"/proc/{w}") and not zombie(w)]
        assert not left, f"workers {left} outlived rank 0"
    finally:
        kill_all(workers)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)


def zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True
