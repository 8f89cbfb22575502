"""One rule, one message, at every door (validation.py): the same bad value given to the Python API
(SamplingParams / EngineConfig / LLM), the command line and the server is refused with the same
words -- each door names the field its own way (top_p, --top-p, the JSON field top_p), and what
follows, "must be <expected>, found <value>", is identical. The server checks each request once."""
from __future__ import annotations

import httpx
import pytest

import pagedlab.__main__ as cli
from helpers import tiny_llm
from pagedlab import EngineConfig, SamplingParams
from pagedlab.server import serve
from pagedlab.validation import ValidationError

# (SamplingParams keyword, value, CLI flag, JSON field); the CLI gets str(value)
SAMPLING = [
    ("top_p", 2.0, "--top-p", "top_p"),
    ("top_p", 0.0, "--top-p", "top_p"),
    ("temperature", -1.0, "--temperature", "temperature"),
    ("top_k", -3, "--top-k", "top_k"),
    ("seed", -1, "--seed", "seed"),
    ("seed", 2**63, "--seed", "seed"),
    ("max_tokens", 0, "--max-tokens", "max_tokens"),
]
# refused by SamplingParams and the server (no such flag): types the CLI cannot even parse
SERVER_ONLY = [
    ("stop_token_ids", [3, 1.5], "stop_token_ids"),
    ("temperature", "1", "temperature"),
    ("max_tokens", 2.0, "max_tokens"),
    ("presence_penalty", 3, "presence_penalty"),
]


def tail(message: str, name: str) -> str:
    """What follows the field's name: "must be ..., found ..." (the name must come right before)."""
    head, sep, rest = message.partition(" must be ")
    assert sep and head.endswith(name), (name, message)
    return "must be " + rest


def python_message(field, value) -> str:
    with pytest.raises(ValidationError) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith("SamplingParams: ")
    return str(e.value)


def cli_message(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


@pytest.fixture(scope="module")
def server():
    s = serve(tiny_llm(max_num_seqs=2, num_blocks=64), model_name="tiny", port=0, max_waiting=8)
    yield s
    s.stop()


def server_message(server, field, value) -> str:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, field: value}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field.split("[")[0], err
    return err["message"]


@pytest.fixture
def no_loading(monkeypatch):
    import pagedlab.llm

    def boom(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")
    monkeypatch.setattr(pagedlab.llm, "LLM", boom)


@pytest.mark.parametrize("field,value,flag,param", SAMPLING, ids=[f"{f}={v}" for f, v, _, _ in SAMPLING])
def test_the_same_bad_value_gets_the_same_message_at_every_door(field, value, flag, param, server,
                                                                no_loading, capsys):
    py = python_message(field, value)
    cli_line = cli_message(["generate", flag, str(value), "hi"], capsys)
    http = server_message(server, param, value)
    assert tail(py, field) == tail(cli_line, flag if flag != "--max-tokens" else "--max-new-tokens)") \
        == tail(http, param)
    assert flag in cli_line


@pytest.mark.parametrize("field,value,param", SERVER_ONLY, ids=[f"{f}={v!r}" for f, v, _ in SERVER_ONLY])
def test_types_are_judged_by_the_same_rule_in_python_and_json(field, value, param, server):
    py = python_message(field, value)
    name = field if not isinstance(value, list) else f"{field}[1]"
    assert tail(py, name) == tail(server_message(server, param, value), name)


@pytest.mark.parametrize("kw,flag,value", [("dtype", "--dtype", "int8"), ("device", "--device", "tpu"),
                                           ("max_num_seqs", "--max-num-seqs", "0"),
                                           ("memory_fraction", "--gpu-memory-utilization", "1.5")])
def test_engine_settings_read_the_same_from_python_and_the_cli(kw, flag, value, no_loading, capsys):
    v = {"max_num_seqs": int, "memory_fraction": float}.get(kw, str)(value)
    with pytest.raises(ValidationError) as e:
        EngineConfig(**{kw: v})
    line = cli_message(["generate", flag, value, "hi"], capsys)
    assert tail(str(e.value), kw) == tail(line, flag if kw != "max_num_seqs" else "--max-num-seqs)")


def test_half_is_float16_through_one_table(no_loading, capsys, monkeypatch):
    assert EngineConfig(dtype="half").dtype == EngineConfig(dtype="HALF").dtype == "float16"
    args = cli.build_parser().parse_args(["generate", "--dtype", "half", "--device", "cpu", "hi"])
    cli.check_args(args)
    assert args.engine_kwargs["dtype"] == "float16"


def test_each_server_request_is_checked_once(server, monkeypatch):
    """n = 3 samples of 2 prompts: one engine check per prompt, none again per stream."""
    allm = server.async_llm
    calls = []
    check = allm.check_request

    def counted(*a, **k):
        calls.append(a[0])
        return check(*a, **k)
    monkeypatch.setattr(allm, "check_request", counted)
    body = {"model": "tiny", "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 2, "n": 3, "temperature": 1.0,
            "seed": 4}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 6
    assert calls == [[5, 6, 7], [8, 9]]


def test_n_expansion_is_defined_once():
    sp = SamplingParams(n=3, temperature=1.0, seed=2**63 - 2)
    s = sp.samples()
    assert [p.n for p in s] == [1, 1, 1] and [p.seed for p in s] == [2**63 - 2, 2**63 - 1, 0]
    assert [p.seed for p in SamplingParams(n=2, temperature=1.0).samples()] == [None, None]
    assert SamplingParams().samples() == [SamplingParams()]


def test_llm_checks_its_engine_settings_before_loading(monkeypatch):
    import pagedlab.llm

    def boom(*a, **k):
        raise AssertionError("the checkpoint was loaded before the settings were checked")
    monkeypatch.setattr(pagedlab.llm, "load_checkpoint", boom)
    with pytest.raises(ValidationError, match=r"^block_size must be an integer >= 1, found 0$"):
        pagedlab.llm.LLM("random:tiny", device="cpu", block_size=0)
    with pytest.raises(ValidationError, match=r"^dtype must be None or one of .*found 'int8'$"):
        pagedlab.llm.LLM("random:tiny", device="cpu", dtype="int8")
