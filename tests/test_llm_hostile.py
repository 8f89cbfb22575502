"""Hostile use of the in-process API (LLM.generate / chat / stream, AsyncLLM(llm), the CLI): every
bad input is a ValueError / TypeError naming it, before anything is queued; nothing wedges the
engine, leaks a KV block or changes another request's tokens; the same LLM keeps working."""
import asyncio
import dataclasses
import time

import numpy as np
import pytest

import pagedlab.__main__ as cli
from helpers import tiny_llm
from pagedlab import SamplingParams
from pagedlab.async_llm import AsyncLLM

SP = SamplingParams(max_tokens=4, ignore_eos=True)


def idle(llm) -> bool:
    eng = llm.engine
    return not eng.has_work() and eng.scheduler.allocator.num_used == 0 and not llm.outputs.states


@pytest.fixture(scope="module")
def llm():
    return tiny_llm(max_num_seqs=2, num_blocks=64)


@pytest.fixture(scope="module")
def want(llm):
    return llm.generate([[3, 4, 5]], SP)[0].token_ids


# -- text that is not valid Unicode ----------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda llm: llm.generate("a\udcffb", SP), r"^the prompt's text is not valid Unicode: '\\udcff' at index 1"),
    (lambda llm: llm.generate(["fine", "a\ud800"], SP), r"^prompt 1: the prompt's text is not valid Unicode"),
    (lambda llm: llm.chat("a\ud800", SP), r"^the prompt's text is not valid Unicode"),
    (lambda llm: llm.chat([{"role": "user", "content": "ok"}, {"role": "assistant", "content": "\udc80"}], SP),
     r"^messages\[1\]\.content is not valid Unicode"),
    (lambda llm: llm.chat("hi", SP, system="x\ud800"), r"^system is not valid Unicode"),
    (lambda llm: next(llm.stream("\udfff", SP)), r"^the prompt's text is not valid Unicode"),
])
def test_a_lone_surrogate_is_a_value_error_naming_where(llm, want, call, match):
    """Was: the byte tokenizer's UnicodeEncodeError re-raised as type(e)(msg) -> "TypeError: function
    takes exactly 5 arguments (1 given)"; SmolLM2's tokenizer: "TextEncodeInput must be Union[...]"."""
    with pytest.raises(ValueError, match=match):
        call(llm)
    assert idle(llm)
    assert llm.generate([[3, 4, 5]], SP)[0].token_ids == want


def test_a_command_line_argument_that_is_not_utf8_is_one_line(capsys):
    """Python reads argv bytes that are not UTF-8 as lone surrogates ('\\udcff'): one error line, no traceback."""
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", "random:tiny", "--device", "cpu", "--max-tokens", "2", "ok", "a\udcffb"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: prompt 1: the prompt's text is not valid Unicode") and "Traceback" not in err, err


# -- a callback that drives the engine itself ------------------------------------------------------

def test_generate_inside_on_finish_does_not_wedge_the_outer_call():
    """Was: the inner generate() stepped the core and took the outer call's endings, and the outer
    loop stepped an empty engine forever."""
    sps = [SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(max_tokens=8, ignore_eos=True)]
    prompts = [[3, 4, 5], [6, 7, 8, 9]]
    inner_sp = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = tiny_llm(max_num_seqs=2, num_blocks=64)
    want, want_inner = ref.generate(prompts, sps), ref.generate([[10, 11]], inner_sp)[0].token_ids
    llm = tiny_llm(max_num_seqs=2, num_blocks=64)
    step, idle_steps = llm.core.step, [0]

    def watched_step():
        idle_steps[0] += not llm.core.has_work()
        assert idle_steps[0] < 50, "generate() steps an idle engine: it waits for an ending it will never see"
        return step()
    llm.core.step = watched_step
    inner, finished = [], []

    def on_finish(out):
        finished.append(out.request_id)
        if not inner:
            inner.append(llm.generate([[10, 11]], inner_sp)[0].token_ids)
            inner.append([d for d in llm.stream([10, 11], inner_sp)][-1].output.token_ids)
    outs = llm.generate(prompts, sps, on_finish=on_finish)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert inner == [want_inner, want_inner] and sorted(finished) == sorted(o.request_id for o in outs)
    assert idle(llm)


# -- AsyncLLM(llm) -------------------------------------------------------------------------------

def test_async_llm_survives_an_asyncio_run_that_ended_while_its_request_ran():
    """The notebook way: one asyncio.run per cell. Was: the first run's loop closed while its
    aborted request still had a step to hand out; the engine thread's wake-up on the closed loop
    raised, the thread died holding the request's KV blocks, and every later call failed."""
    llm = tiny_llm(max_num_seqs=2, num_blocks=64)
    allm = AsyncLLM(llm)

    async def first_delta():
        async for d in allm.generate([3, 4, 5], SamplingParams(max_tokens=500, ignore_eos=True)):
            return d.token_ids

    async def whole():
        return [d async for d in allm.generate([3, 4, 5], SP)][-1].output.token_ids
    try:
        assert len(asyncio.run(first_delta())) >= 1
        for _ in range(400):                    # the abort reaches the core and is handed out
            if idle(llm) or not allm.is_alive():
                break
            time.sleep(0.01)
        assert allm.is_alive(), allm.core_status()
        assert asyncio.run(whole()) == tiny_llm(max_num_seqs=2, num_blocks=64).generate([[3, 4, 5]], SP)[0].token_ids
    finally:
        allm.shutdown()
    assert idle(llm) or llm.engine.scheduler.allocator.num_used == 0


def test_generate_refuses_while_an_async_llm_drives_the_same_engine(want):
    """Was: llm.generate stepped the core from this thread while AsyncLLM's engine thread stepped it
    too; each took the other's tokens (wrong outputs, or the engine thread died)."""
    llm = tiny_llm(max_num_seqs=2, num_blocks=64)
    allm = AsyncLLM(llm)
    try:
        with pytest.raises(RuntimeError, match="driven by an AsyncLLM"):
            llm.generate([[3, 4, 5]], SP)
        with pytest.raises(RuntimeError, match="driven by an AsyncLLM"):
            next(llm.stream([3, 4, 5], SP))
        with pytest.raises(RuntimeError, match="already driven by another AsyncLLM"):
            AsyncLLM(llm)
    finally:
        allm.shutdown()
    assert llm.generate([[3, 4, 5]], SP)[0].token_ids == want     # shut down: the LLM's own again
    AsyncLLM(llm).shutdown()


# -- prompts and params of the wrong shape -------------------------------------------------------

@pytest.mark.parametrize("prompts, match", [
    ({"role": "user", "content": "hi"}, "got a dict: a conversation is a list of messages"),
    ({"a", "b"}, "prompts must be ordered"),
    (np.array([[3, 4], [5, 6]]), r"must be 1-D .* got shape \(2, 2\)"),
])
def test_prompts_that_would_be_misread_are_refused(llm, prompts, match):
    """Was: a dict's keys ('role', 'content') were generated as two prompts, a set in hash order."""
    with pytest.raises((TypeError, ValueError), match=match):
        llm.generate(prompts, SP)
    assert idle(llm)


def test_a_numpy_prompt_is_one_prompt_as_a_tensor_is(llm, want):
    """Was: a 1-D numpy array was split into one prompt per token ("prompt 0: ... got int64")."""
    assert [o.token_ids for o in llm.generate(np.array([3, 4, 5]), SP)] == [want]
    assert [o.token_ids for o in llm.generate([np.array([3, 4, 5], dtype=np.int32), [3, 4, 5]], SP)] == [want, want]
    with pytest.raises(ValueError, match="element 0 is 3.0 .float."):
        llm.generate(np.array([3, 4.5]), SP)


def test_none_in_a_params_list_is_the_defaults_and_a_bad_entry_is_named(llm):
    """Was: None in the list passed the checks and failed in core.add (AttributeError: 'NoneType'
    object has no attribute 'seed') after the requests before it were queued."""
    outs = llm.generate([[3, 4, 5], [6, 7]], [SP, None])
    assert outs[1].token_ids == llm.generate([[6, 7]], SamplingParams())[0].token_ids
    with pytest.raises(TypeError, match=r"^params\[1\] must be a SamplingParams .* got \{'max_tokens': 3\} \(dict\)"):
        llm.generate([[3, 4, 5], [6, 7]], [SP, {"max_tokens": 3}])
    with pytest.raises(TypeError, match=r"^params must be a SamplingParams, a list of them"):
        llm.generate([[3, 4, 5], [6, 7]], {"max_tokens": 3})
    assert idle(llm)


def test_a_callback_that_is_not_callable_is_refused_before_anything_runs(llm):
    """Was: "'int' object is not callable" once the first request had finished, the rest aborted."""
    steps = llm.core.num_steps
    with pytest.raises(TypeError, match="on_finish must be a function"):
        llm.generate([[3, 4], [5, 6]], SP, on_finish=5)
    assert llm.core.num_steps == steps and idle(llm)


def test_replace_with_max_tokens_says_how_to_derive():
    """dataclasses.replace passes every field, so replace(sp, max_tokens=N) meets max_new_tokens too."""
    with pytest.raises(ValueError, match=r"replace\(params, max_new_tokens=9\)"):
        dataclasses.replace(SamplingParams(max_tokens=5), max_tokens=9)
    assert dataclasses.replace(SamplingParams(max_tokens=5), max_new_tokens=9).max_tokens == 9


def test_a_huge_integer_as_prompts_is_named_not_printed(llm):
    """Was: repr(10**5000) inside the message raised "Exceeds the limit (4300 digits) for integer
    string conversion" (a ValueError that names nothing) in place of the TypeError."""
    with pytest.raises(TypeError, match=r"^prompts must be .* got <an integer of 16610 bits> \(int\)"):
        llm.generate(10**5000, SP)


@pytest.mark.parametrize("prompt, match", [
    ([3, 10 ** 5000], r"^token id\(s\) \[<an integer of \d+ bits>\] \(at index \[1\]\) outside the vocabulary"),
    ([3, 10 ** 400, -1], r"^token id\(s\) \[<an integer of \d+ bits>, -1\] \(at index \[1, 2\]\)"),
])
def test_a_huge_out_of_vocabulary_id_is_named_not_printed(llm, want, prompt, match):
    with pytest.raises(ValueError, match=match) as e:
        llm.generate([prompt], SP)
    assert len(str(e.value)) < 200
    assert idle(llm) and llm.generate([[3, 4, 5]], SP)[0].token_ids == want


@pytest.mark.parametrize("role", [["user"], {"r": 1}, 7, None])
def test_a_role_of_the_wrong_type_is_named(llm, want, role):
    with pytest.raises(ValueError, match=r"^messages\[0\]\.role must be one of system, user, assistant"):
        llm.chat([{"role": role, "content": "hi"}], SP)
    assert idle(llm) and llm.generate([[3, 4, 5]], SP)[0].token_ids == want
