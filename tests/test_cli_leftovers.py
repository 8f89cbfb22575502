"""Leftovers of the command line's hostile-input sweeps: Ctrl-C while `python -m pagedlab` imports
torch, the draft model's errors under its own flag, --api-servers and --max-waiting bounded up
front, a too-big request's error naming what the request gave (its prompts, not `n`), and
`generate --data-parallel-size 2` leaving at once after a Ctrl-C.

Processes run in sessions of their own (the `procs` fixture of test_cli_signals.py SIGKILLs each
at the end, pass or fail)."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import pagedlab.__main__ as cli
from helpers import random_prompts, tiny_llm
from pagedlab import SamplingParams, tiny_config
from test_cli_signals import MODEL, ROOT, free_port, one_line_error, procs, run_main, session_left  # noqa: F401

NO_MODEL = "/no/such/model"     # a run that gets past the checks fails at once, naming --model


def mapped(pid: int, name: str) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return name in f.read()
    except OSError:
        return False


# -- 1. Ctrl-C while the package and torch import -------------------------------------------------

@pytest.mark.parametrize("when", ["at once", "torch loading"])
def test_ctrl_c_while_python_m_pagedlab_imports_is_one_line(procs, when):
    """`import pagedlab` imported torch (1-2 s), before __main__ could say anything: a Ctrl-C then
    was a KeyboardInterrupt traceback (from pagedlab/__init__.py, or inside torch). Now the package's
    names come on first use, torch's import is one piece that a Ctrl-C ends after, and the command
    says `interrupted`, status 130. ("at once": 0.15 s in; a signal before Python has its handler
    kills it quietly, as a shell's Ctrl-C does.)"""
    p = procs("generate", "--model", MODEL, "--device", "cpu", "hi")
    if when == "at once":
        time.sleep(0.15)
    else:
        end = time.monotonic() + 30
        while not mapped(p.pid, "libtorch") and p.poll() is None and time.monotonic() < end:
            time.sleep(0.005)
        assert mapped(p.pid, "libtorch"), "torch was not loaded in 30 s"
    t0 = time.monotonic()
    os.killpg(p.pid, signal.SIGINT)
    code = p.wait(30)
    out = p.stdout.read()
    assert "Traceback" not in out and len(out.strip().splitlines()) <= 1, out
    if code == -signal.SIGINT:               # before Python's own handler: nothing said
        assert when == "at once" and out.strip() == "", out
    else:
        assert code == 130 and out.strip() == "interrupted", (code, out)
    assert time.monotonic() - t0 < 10


def test_import_pagedlab_is_lazy_and_keeps_every_public_name():
    """`import pagedlab` imports no torch; every public name is there, on first use (attribute,
    `from pagedlab import ...`, `*`, dir()), as are the package's modules (`pagedlab.weights`)."""
    code = """if True:
        import sys
        import pagedlab
        assert set(pagedlab.__all__) <= set(dir(pagedlab))
        from pagedlab import LLM, SamplingParams, EngineConfig, load_checkpoint
        import pagedlab.llm
        assert LLM is pagedlab.LLM is pagedlab.llm.LLM and SamplingParams().max_tokens > 0
        ns = {}
        exec("from pagedlab import *", ns)
        assert set(pagedlab.__all__) <= set(ns), set(pagedlab.__all__) - set(ns)
        assert pagedlab.weights.load_checkpoint is load_checkpoint and pagedlab.tiny_config().vocab_size
        assert "pagedlab.server" not in sys.modules
        try:
            pagedlab.no_such_name
        except AttributeError as e:
            assert "no_such_name" in str(e)
        else:
            raise AssertionError("pagedlab.no_such_name")
        print("ok", pagedlab.__version__)
    """
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok "), r.stderr[-3000:]


def test_python_m_pagedlab_imports_no_torch_before_its_command_runs(tmp_path):
    """Under `python -m pagedlab` the package's import is quick (no torch: the CLI takes Ctrl-C
    before torch loads); a plain `import pagedlab` reads torch's own CPU thread count at once, so a
    torch.set_num_threads(n) after it and before the LLM stays the user's (cpu_threads.py)."""
    r = subprocess.run([sys.executable, "-c", "import sys; sys.argv = ['-m']; import pagedlab; "
                        "print('torch' in sys.modules)"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", (r.stdout, r.stderr[-2000:])
    code = """if True:
        import os
        for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PAGEDLAB_CPU_THREADS"):
            os.environ.pop(v, None)
        import pagedlab
        import torch
        mine = 3 if torch.get_num_threads() != 3 else 2
        torch.set_num_threads(mine)
        llm = pagedlab.LLM("random:tiny", device="cpu", show_progress=False)
        assert torch.get_num_threads() == mine, (torch.get_num_threads(), mine)
        print("ok")
    """
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PAGEDLAB_CPU_THREADS")}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


# -- 2. the draft model's errors -----------------------------------------------------------------

@pytest.mark.parametrize("draft,said", [
    ("/no/such/draft", "error: --speculative-config: model: Model '/no/such/draft' not found"),
    ("random:nope", "error: --speculative-config: model: Unknown random preset 'nope'"),
    ("  ", "error: --speculative-config: model must be a name or path LLM() loads"),   # before loading
])
def test_draft_model_errors_name_the_speculative_config_flag(capsys, draft, said):
    """A draft model that cannot be loaded was said as "--model: ...", the target's flag."""
    spec = '{"method": "draft", "num_speculative_tokens": 2, "model": "%s"}' % draft
    code, err = run_main(["generate", "--model", MODEL, "--device", "cpu", "--speculative-config", spec, "hi"],
                         capsys)
    line = one_line_error(err)
    assert code == 2 and line.startswith(said) and "--model" not in line, err


def test_draft_model_errors_in_serve_and_the_python_api(capsys):
    """serve: the engine core's error comes back (CoreStartError) and is said the same way. In
    Python the message says it is the draft's; a vocabulary unlike the target's is a
    ValidationError of speculative_config's model."""
    from pagedlab import LLM
    from pagedlab.validation import ValidationError
    from pagedlab.weights import ModelNotFound, random_checkpoint
    spec = '{"method": "draft", "model": "random:nope"}'
    code, err = run_main(["serve", "--model", MODEL, "--device", "cpu", "--port", str(free_port()),
                          "--speculative-config", spec], capsys)
    assert code == 2 and one_line_error(err).startswith(
        "error: --speculative-config: model: Unknown random preset 'nope'"), err
    with pytest.raises(ModelNotFound, match=r"^speculative_config: model: Model '/no/such/draft' not found"):
        LLM(MODEL, device="cpu", show_progress=False, speculative_config={"method": "draft", "model": "/no/such/draft"})
    other = random_checkpoint(tiny_config(vocab_size=300))
    with pytest.raises(ValidationError) as e:
        LLM(MODEL, device="cpu", show_progress=False, speculative_config={"method": "draft", "model": other})
    assert (e.value.owner, e.value.field) == ("speculative_config", "model") and "300 tokens" in str(e.value)
    assert cli.flagged(e.value) == ("--speculative-config: model must be a model with the target's vocabulary "
                                    "(512 tokens: the same tokenizer), found a model (300 tokens)")


# -- 3, 4. --api-servers and --max-waiting: bounded, refused up front ----------------------------

def test_api_servers_past_the_machine_is_refused_naming_the_flag(capsys, monkeypatch):
    """--api-servers 99999999999 opened sockets until "Too many open files" (the flag not named).
    Now at most one front end per CPU (2 on any machine), and what `ulimit -n` leaves room for."""
    cpus = len(os.sched_getaffinity(0))
    t0 = time.monotonic()
    code, err = run_main(["serve", "--model", NO_MODEL, "--device", "cpu", "--port", "0",
                          "--api-servers", "99999999999"], capsys)
    line = one_line_error(err)
    assert code == 2 and line.startswith(f"error: --api-servers must be an integer in [1, {max(2, cpus)}]"), err
    assert "found 99999999999" in line and "CPU" in line and time.monotonic() - t0 < 10
    # a low open-files limit bounds it too, more so with more engine cores (pipes to each)
    monkeypatch.setattr(cli, "open_files_limit", lambda: 84)
    assert cli.api_servers_limit(1)[0] == 2 and cli.api_servers_limit(2)[0] == 1
    code, err = run_main(["serve", "--model", NO_MODEL, "--device", "cpu", "--port", "0", "--api-servers", "2",
                          "--data-parallel-size", "2"], capsys)
    line = one_line_error(err)
    assert code == 2 and line.startswith("error: --api-servers must be an integer in [1, 1]") and \
        "ulimit -n 84" in line, err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())             # --help explains the bound
    assert "ulimit -n" in text.split("--api-servers N, --api-server-count N")[1].split("--engine-thread")[0]


def test_max_waiting_is_bounded_by_the_open_files_limit(capsys, monkeypatch):
    """--max-waiting took any size (10**11: no bound at all); every waiting request holds a
    connection, and a front end holds at most `ulimit -n` files: past that the server fails to
    accept before it would answer 503. Refused, naming the flag and the bound; the default (256)
    is always allowed."""
    code, err = run_main(["serve", "--model", NO_MODEL, "--device", "cpu", "--port", "0",
                          "--max-waiting", "99999999999"], capsys)
    line = one_line_error(err)
    assert code == 2 and line.startswith("error: --max-waiting must be an integer in [0, ") and \
        "ulimit -n" in line and "found 99999999999" in line, err
    monkeypatch.setattr(cli, "open_files_limit", lambda: 1064)
    assert cli.max_waiting_limit(1)[0] == 1000 and cli.max_waiting_limit(2)[0] == 2000
    monkeypatch.setattr(cli, "open_files_limit", lambda: 200)
    assert cli.max_waiting_limit(1)[0] == 256                 # the default, even under a low limit
    monkeypatch.setattr(cli, "open_files_limit", lambda: None)
    assert cli.max_waiting_limit(1)[0] == 2**20
    code, err = run_main(["serve", "--model", NO_MODEL, "--device", "cpu", "--port", "0",
                          "--max-waiting", str(2**20 + 1)], capsys)
    assert code == 2 and one_line_error(err).startswith("error: --max-waiting must be an integer in [0, 1048576]")


# -- 5. a request too big for the server: what it gave is named ----------------------------------

def test_too_many_prompts_name_the_prompts_not_n():
    """`{"prompt": ["a", "b"]}` (no n) on a server running at most 1 stream at once was refused as
    "this request needs 2 streams (prompts x n)", param "n": a field the client never sent."""
    from pagedlab.server.admission import AdmissionGate
    from pagedlab.server.protocol import OpenAIError
    gate = AdmissionGate(slots=1, max_waiting=1)
    cases = [(3, 3, "prompt", "3 prompts"), (3, 1, "n", "n=3"), (4, 2, "n", "2 prompts x n=2"),
             (6, 3, "prompt", "3 prompts x n=2")]
    for streams, prompts, param, said in cases:
        with pytest.raises(OpenAIError) as e:
            gate.admit(streams, prompts=prompts)
        assert e.value.param == param and said in str(e.value), (streams, prompts, str(e.value))
    assert "(prompts x n)" not in str(e.value)
    with pytest.raises(OpenAIError) as e:
        gate.admit(3)                                        # (callers that give the streams only)
    assert e.value.param == "n"


def test_too_many_prompts_over_http():
    pytest.importorskip("fastapi")
    import httpx

    from pagedlab import LLM
    from pagedlab.server import serve
    s = serve(LLM(MODEL, device="cpu", max_num_seqs=1, show_progress=False), port=0, max_waiting=0)
    try:
        r = httpx.post(s.url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt" and "2 prompts" in err["message"], err
        assert "n=" not in err["message"] and "x n" not in err["message"]
    finally:
        s.stop()


# -- 6. data parallel: Ctrl-C is prompt -----------------------------------------------------------

def test_ctrl_c_while_the_data_parallel_workers_start_exits_at_once(procs):
    """Ctrl-C while rank 0 waited for its worker to start: the exit then said goodbye to a worker
    still importing (it could not hear it) and waited JOIN_TIMEOUT_S (20 s) before ending it. Now
    a Ctrl-C during the world's setup ends the workers at once: out in ~1 s, 130, nothing left."""
    p = procs("generate", "--model", MODEL, "--device", "cpu", "--data-parallel-size", "2", "hi")
    worker, end = None, time.monotonic() + 60
    while worker is None and time.monotonic() < end and p.poll() is None:
        out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(p.pid)], capture_output=True,
                             text=True).stdout
        worker = next((int(line.split()[0]) for line in out.splitlines() if "spawn_main" in line), None)
        time.sleep(0.02)
    assert worker is not None, "no worker process appeared"
    time.sleep(0.3)                          # it is importing; rank 0 waits for it
    t0 = time.monotonic()
    os.killpg(p.pid, signal.SIGINT)
    try:
        code = p.wait(20)
    except subprocess.TimeoutExpired:
        pytest.fail("generate --data-parallel-size 2 did not exit 20 s after Ctrl-C")
    took = time.monotonic() - t0
    out = p.stdout.read()
    assert code == 130 and out.strip() == "interrupted", (code, out)
    assert took < 3, took
    time.sleep(0.5)
    assert not session_left(p.pid)


def test_ctrl_c_during_a_data_parallel_generate_stops_every_replica_at_once():
    """generate() interrupted on rank 0 waited for each replica to finish its whole share before
    the KeyboardInterrupt came out (the router stays in step with them): on a long run, as long as
    the run. Now the replicas are told (WorldSpec.stop) and end their shares at their next step; the
    LLM stays usable -- the next generate gives the same tokens."""
    rng = torch.Generator().manual_seed(5)
    prompts = random_prompts(24, 512, rng, lo=20, hi=60)
    params = SamplingParams(max_new_tokens=150, ignore_eos=True)
    with tiny_llm(max_num_seqs=2, data_parallel_size=2) as llm:
        t0 = time.perf_counter()
        want = [o.token_ids for o in llm.generate(prompts, params)]
        run_s = time.perf_counter() - t0
        for frac in (0.1, 0.5):
            sent = []

            def ctrl_c():
                sent.append(time.perf_counter())
                os.kill(os.getpid(), signal.SIGINT)
            timer = threading.Timer(run_s * frac, ctrl_c)
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                llm.generate(prompts, params)
            took = time.perf_counter() - sent[0]
            timer.join()
            assert took < max(0.25 * run_s, 0.3), (took, run_s)
            assert [o.token_ids for o in llm.generate(prompts, params)] == want
    deadline = time.monotonic() + 10
    import multiprocessing
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()
