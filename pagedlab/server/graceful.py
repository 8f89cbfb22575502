"""uvicorn's server whose open requests end with an answer when it stops (a stream's shutdown error
event and [DONE]): the one-front-end server (run.py) and each of serve --api-servers' front ends
(frontends.py) run it."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:
    from ..async_llm import AsyncLLM


class Server(uvicorn.Server):
    """uvicorn's server, whose requests still open when it stops end with an answer. uvicorn lets
    them run `timeout_graceful_shutdown` s, then cancels their tasks: a stream is cut mid-body (the
    client reads "incomplete chunked read", no error event, no [DONE]) and each logs a traceback
    of its CancelledError; after a second Ctrl-C (force exit) it does not wait at all and asyncio
    cancels them the same way. Here, just before that, every open request is ended as a shutdown
    ends it (finish_reason "abort": a stream's error event "the server is shutting down" and
    [DONE], a whole answer's 503) and given a moment to be sent."""

    END_AFTER_S = 1.0           # before uvicorn's grace runs out (its default: 5 s, app.uvicorn_config)
    SEND_S = 1.0                # for the ended requests' last bytes

    def __init__(self, config, async_llm: AsyncLLM):
        super().__init__(config)
        self.async_llm = async_llm

    def end_open_requests(self) -> None:
        self.async_llm._end_callers(lambda caller: True, "abort", None)

    async def shutdown(self, sockets=None) -> None:
        grace = self.config.timeout_graceful_shutdown

        async def end_in_time():
            await asyncio.sleep(max(0.0, grace - self.END_AFTER_S) if grace is not None else 1e9)
            self.end_open_requests()
        ender = asyncio.ensure_future(end_in_time())
        try:
            await super().shutdown(sockets)
        finally:
            ender.cancel()
        tasks = [t for t in self.server_state.tasks if not t.done()]
        if tasks:                   # a forced exit (second Ctrl-C): uvicorn waited for nothing
            self.end_open_requests()
            await asyncio.wait(tasks, timeout=self.SEND_S)
            if self.force_exit:     # (uvicorn skips the app's shutdown: a task left on the loop
                try:        # is cancelled by asyncio.run with a traceback)
                    await asyncio.wait_for(self.lifespan.shutdown(), self.SEND_S)
                except (asyncio.TimeoutError, Exception):      # noqa: BLE001
                    pass
