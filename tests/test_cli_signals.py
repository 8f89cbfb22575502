"""The command line and the serving processes under hostile arguments and signals: what a user sees
is one line (`error: ...` and exit status 2, or `interrupted` and 130), never a traceback, and no
process is left behind. (Arguments checked before loading: test_cli.py, test_server.py; a killed
server or core: test_engine_core.py, test_api_servers.py.)

Every server here runs in a session of its own; the `procs` fixture SIGKILLs each session at the
end, pass or fail, so nothing outlives a test."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

import pagedlab.__main__ as cli

MODEL = "random:tiny"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_main(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    code = e.value.code
    return code, capsys.readouterr().err


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) >= 1 and lines[-1].startswith("error: "), err
    return lines[-1]


# -- arguments whose trouble shows once the model loads --------------------------------------------

def test_slots_past_memory_is_one_line(capsys):
    """--slots 99999999999 passes the checks (an integer >= 1) and the engine's slot list cannot
    be made: MemoryError, one line, not a traceback."""
    code, err = run_main(["generate", "--model", MODEL, "--device", "cpu", "--slots", "99999999999", "hi"],
                         capsys)
    assert code == 2 and "MemoryError" in one_line_error(err) and "--slots" in err


def test_serve_host_not_utf8_and_max_model_len_past_int32_are_one_line(capsys):
    code, err = run_main(["serve", "--model", MODEL, "--device", "cpu", "--port", "0",
                          "--host", b"\xff".decode("utf-8", "surrogateescape")], capsys)   # non-UTF-8 argv
    assert code == 2 and "--host" in one_line_error(err)
    code, err = run_main(["serve", "--model", MODEL, "--device", "cpu", "--port", "0",
                          "--max-model-len", str(10 ** 20)], capsys)
    assert code == 2 and "--max-model-len" in one_line_error(err)


def test_ctrl_c_before_the_command_runs_is_one_line(monkeypatch, capsys):
    """Ctrl-C while the arguments are checked (imports, building the objects) is `interrupted` and
    130, as it is during the command."""
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "check_args", interrupted)
    try:
        code = cli.main(["generate", "--model", MODEL, "hi"])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped main(): a traceback for the user")
    assert code == 130
    assert capsys.readouterr().err.strip() == "interrupted"


# -- processes -----------------------------------------------------------------------------------

@pytest.fixture
def procs():
    """Start `python -m pagedlab ...` in sessions of their own; every session is SIGKILLed at the end."""
    started = []

    def start(*argv):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        p = subprocess.Popen([sys.executable, "-m", "pagedlab", *argv], cwd=ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        started.append(p)
        return p
    yield start
    for p in started:
        try:
            os.killpg(p.pid, signal.SIGCONT)
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)


def session_left(pgid: int) -> list[str]:
    """The processes of session `pgid` still running (zombies waiting for init do not count)."""
    out = subprocess.run(["ps", "-eo", "pgid=,stat=,pid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split()[0] == str(pgid) and not line.split()[1].startswith("Z")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving(start, *more):
    port = free_port()
    p = start("serve", "--model", MODEL, "--device", "cpu", "--port", str(port), "--slots", "2",
              "--log-level", "warning", *more)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            h = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            if h.status_code == 200:
                return p, f"http://127.0.0.1:{port}", h.json()["engine_cores"][0]["pid"]
        except httpx.HTTPError:
            pass
        assert p.poll() is None, p.stdout.read()
        time.sleep(0.1)
    raise AssertionError("the server did not start in 60 s")


def open_streams(url: str, n: int):
    """n streamed completions on threads; returns (threads, {i: the data lines it read})."""
    events = {i: [] for i in range(n)}
    started = threading.Barrier(n + 1, timeout=30)

    def one(i):
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json=dict(
                    model=MODEL, prompt=[5 + i, 6], max_tokens=200, ignore_eos=True, stream=True)) as r:
                first = True
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        events[i].append(line)
                        if first:
                            first = False
                            started.wait()
        except httpx.HTTPError as e:
            events[i].append(f"cut: {e!r}")
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    started.wait()                          # every stream has its first event
    return threads, events


def finished(lines) -> bool:
    """Has a stream read its last token (a finish_reason, or [DONE])?"""
    return any(line == "data: [DONE]" or '"finish_reason":"' in line for line in lines)


def streams_open_at_a_stopped_core(url: str, n: int, core: int, tries: int = 5):
    """open_streams, then SIGSTOP the core with every stream still open. The streams' first events
    come one by one; on a busy machine one stream could read all its 200 tokens before the last had
    its first (CI, 2026-12-04: stream 0 ended "length" before the stop and the test failed on a
    premise, not on the server). So: stop, let what was already on its way arrive, and if a stream
    finished, let the core go, end those streams and open new ones."""
    for _ in range(tries):
        threads, events = open_streams(url, n)
        os.kill(core, signal.SIGSTOP)
        time.sleep(0.5)                     # outputs the front end already had reach the client
        if not any(finished(ev) for ev in events.values()):
            return threads, events
        os.kill(core, signal.SIGCONT)
        for t in threads:
            t.join(60)
    raise AssertionError(f"in {tries} tries a stream always finished before the core was stopped")


def assert_ended_with_an_error_event(events):
    for i, ev in events.items():
        assert ev[-1] == "data: [DONE]" and "the server is shutting down" in ev[-2], (i, ev[-2:])


@pytest.mark.parametrize("second_ctrl_c", [False, True])
def test_ctrl_c_ends_open_streams_with_an_error_event(procs, second_ctrl_c):
    """Ctrl-C with streams that outlast uvicorn's 5 s grace (their core is stopped: SIGSTOP), or a
    second Ctrl-C (uvicorn's force exit, no grace): each stream ends with the shutdown's error
    event and [DONE] -- not cut mid-body -- and the console shows no traceback (uvicorn logged one
    per cancelled stream), nor triton's ~30 lines of "nanobind: leaked ..." per process (the heap
    frozen by freeze_heap was never handed back at exit). Exit status 130, nothing left running."""
    p, url, core = serving(procs)
    threads, events = streams_open_at_a_stopped_core(url, 2, core)
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGINT)
    if second_ctrl_c:
        time.sleep(0.3)
        os.kill(p.pid, signal.SIGINT)
    for t in threads:
        t.join(15)
    took = time.monotonic() - t0
    os.kill(core, signal.SIGCONT)           # (a stopped core would hold the stop up 15 s)
    assert p.wait(30) == 130
    out = p.stdout.read()
    assert_ended_with_an_error_event(events)
    assert took < (3 if second_ctrl_c else 8), took
    assert "Traceback" not in out and "nanobind" not in out and out.strip().endswith("interrupted"), out
    time.sleep(0.5)
    assert not session_left(p.pid)


def test_ctrl_c_while_the_core_starts_is_one_line(procs):
    """Ctrl-C in a terminal reaches the whole process group: the engine core too, while it is still
    importing torch and pagedlab (before core_main can ignore SIGINT). It died there with a
    KeyboardInterrupt traceback (and the server with a RuntimeError naming it); now it is started
    with SIGINT ignored, and Ctrl-C is the server's alone. Here the core gets the signal alone,
    mid-import: it must load and serve regardless."""
    port = free_port()
    p = procs("serve", "--model", MODEL, "--device", "cpu", "--port", str(port), "--log-level", "warning")
    core, end = None, time.monotonic() + 30
    while core is None and time.monotonic() < end:
        out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(p.pid)], capture_output=True, text=True).stdout
        core = next((int(line.split()[0]) for line in out.splitlines() if "spawn_main" in line), None)
        time.sleep(0.02)
    assert core is not None, "no engine core process appeared"
    time.sleep(0.2)                         # it is importing (1-3 s)
    os.kill(core, signal.SIGINT)
    h = None
    while time.monotonic() < end and p.poll() is None:
        try:
            h = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    if p.poll() is None:
        os.kill(p.pid, signal.SIGINT)
    code = p.wait(30)
    out = p.stdout.read()
    assert code == 130, out
    assert h is not None and h.status_code == 200 and h.json()["engine_cores"][0]["pid"] == core, out
    assert "Traceback" not in out and out.strip().endswith("interrupted"), out
    time.sleep(0.5)
    assert not session_left(p.pid)


@pytest.mark.parametrize("api_servers", ["1", "2"])
def test_serve_errors_of_the_engine_core_are_one_line(procs, api_servers):
    """What LLM() raises for a bad model or size is raised in the engine core's process; it came
    back as a RuntimeError holding the core's whole traceback (exit 1). Now the core's exception
    itself comes back (core_process.CoreStartError.error), and the CLI says it in one line, as
    generate does -- also through the front-end processes of --api-servers 2."""
    p = procs("serve", "--device", "cpu", "--port", str(free_port()), "--api-servers", api_servers,
              "--model", "/no/such/model")
    assert p.wait(60) == 2
    out = p.stdout.read()
    assert one_line_error(out).startswith("error: --model: Model '/no/such/model' not found"), out
    time.sleep(0.5)
    assert not session_left(p.pid)


def test_ctrl_c_right_after_serving_is_printed_exits(procs):
    """Ctrl-C just as "serving ..." is printed (the server freezes its heap, then starts uvicorn):
    the KeyboardInterrupt left serve() before the code that stops the engine core, and the exit
    then waited on the running core for ever (multiprocessing joins its children)."""
    p = procs("serve", "--model", MODEL, "--device", "cpu", "--port", str(free_port()))
    while not (line := p.stdout.readline()).startswith("serving") and line:
        pass
    assert line.startswith("serving"), p.stdout.read()
    os.killpg(p.pid, signal.SIGINT)
    try:
        assert p.wait(20) == 130
    except subprocess.TimeoutExpired:
        pytest.fail("the server did not exit 20 s after Ctrl-C")
    assert "Traceback" not in p.stdout.read()
    time.sleep(0.5)
    assert not session_left(p.pid)
