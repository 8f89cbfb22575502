"""The core's outbox (core_mailbox.Outbox): messages written by the caller's thread when the pipe has
room, the rest by a writer thread, in order, readable by a plain Connection.recv, nothing lost while
the reader lags, nothing raised when the reader is gone."""
import multiprocessing
import random
import threading
import time

import pytest

from pagedlab.core_mailbox import Mailbox, Outbox, ThreadOutbox, frame
from pagedlab.output_processor import StepOutput


def pipe():
    r, w = multiprocessing.Pipe(duplex=False)
    return r, w


def test_frame_is_what_connection_send_writes():
    r, w = pipe()
    rng = random.Random(3)
    msgs = [("step", StepOutput(request_ids=[1, 2], token_ids=[[5], [7, 8]])),
            ("stats", {"x": rng.random()}), ("big", bytes(rng.randrange(256) for _ in range(40_000)))]   # < a pipe buffer
    for m in msgs:
        w.send(m)
        a = r.recv_bytes()
        assert frame(m)[4:] == a              # the same pickle behind the same 4-byte length
        assert int.from_bytes(frame(m)[:4], "big") == len(a)


@pytest.mark.parametrize("kind", [Outbox, ThreadOutbox])
def test_a_lagging_reader_gets_every_message_in_order(kind):
    r, w = pipe()
    out = kind(w, "test-writer")
    rng = random.Random(0)
    # sizes from a few bytes to several pipe buffers (64 KiB): partial writes, then the writer's turn
    msgs = [("step", i, bytes(rng.randrange(256) for _ in range(rng.choice([3, 500, 5_000, 90_000, 300_000]))))
            for i in range(60)]
    for m in msgs[:30]:
        out.put(m)                        # nobody reads yet: the pipe fills, the rest waits
    got = []

    def read():
        while len(got) < len(msgs):
            got.append(r.recv())
            if len(got) % 7 == 0:
                time.sleep(0.01)          # a slow reader
    t = threading.Thread(target=read)
    t.start()
    for m in msgs[30:]:
        out.put(m)
    t.join(30)
    assert not t.is_alive()
    assert got == msgs
    out.put(None)
    out.join(10)
    with pytest.raises(EOFError):         # closed once everything was written
        r.recv()
    if kind is Outbox:
        assert out.deferred > 0           # the full pipe was left to the writer thread


def test_small_messages_with_a_reader_keeping_up_are_written_at_once():
    r, w = pipe()
    out = Outbox(w)
    for i in range(200):
        out.put(("step", i))
        assert r.recv() == ("step", i)
    assert (out.direct, out.deferred) == (200, 0)
    out.put(None)
    out.join(10)


def test_a_reader_gone_is_no_error_and_the_writer_ends():
    r, w = pipe()
    out = Outbox(w)
    out.put(("step", b"x" * 200_000))     # more than the pipe holds: the writer thread waits
    r.close()                             # the front end dies
    for i in range(5):
        out.put(("step", i))              # never raises
    out.put(None)
    out.join(10)
    assert not out._writer.is_alive()


@pytest.mark.parametrize("direct", ["1", "0"])
def test_mailbox_hands_out_each_front_end_its_share(direct, monkeypatch):
    monkeypatch.setenv("PAGEDLAB_CORE_DIRECT_SEND", direct)
    ins = [pipe() for _ in range(2)]
    outs = [pipe() for _ in range(2)]
    box = Mailbox([r for r, _ in ins], [w for _, w in outs], stats_every_s=0.0)
    assert isinstance(box._queues[0], Outbox if direct == "1" else ThreadOutbox)
    box.hand_out(StepOutput(request_ids=[0, 1, 2, 3], token_ids=[[10], [11], [12], [13]], stats={"s": 1}))
    kind0, part0 = outs[0][0].recv()
    kind1, part1 = outs[1][0].recv()
    assert (kind0, part0.request_ids, part0.token_ids) == ("step", [0, 2], [[10], [12]])
    assert (kind1, part1.request_ids, part1.token_ids) == ("step", [1, 3], [[11], [13]])
    box.close()
    for r, _ in outs:
        with pytest.raises(EOFError):
            r.recv()


def test_close_with_a_frame_pending_drops_it_and_the_writer_ends():
    """A front end's link closed while the reader lags (CoreLink.close after a stop that timed out):
    the pending frame is dropped, the descriptor closed once, the writer thread ends, later puts are
    no-ops."""
    r, w = pipe()
    out = Outbox(w)
    out.put(("step", b"y" * 300_000))     # more than the pipe holds
    assert out._pending
    out.close()
    out.join(10)
    assert not out._writer.is_alive() and w.closed
    out.put(("step", 1))
    with pytest.raises((EOFError, OSError)):   # part of the dropped frame at most, then end-of-file
        while True:
            r.recv()
