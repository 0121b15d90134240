"""Read timeouts for `apps serve`: uvicorn's HTTP protocol with a clock on each read from a client.

uvicorn bounds only an idle keep-alive connection (`timeout_keep_alive`, after a response): a
client that opens a connection and sends half a request head, or a Content-Length larger than
the body it sends, holds the connection (and the request's task) for as long as it likes. Here a
connection's whole request head must arrive within `read_timeout` seconds of its opening (or of
the previous response, on a keep-alive connection), or it is closed; and each wait for more of a
body is bounded by the same seconds, past which the request is answered 408, OpenAI-shaped, if
no response has started (the connection closed either way). The route never runs: it was still
waiting for its body, and reads a disconnect.

The clock sits in the protocol, not in the application, because only the protocol sees the bytes
arrive: an application that answers without reading the body (a 413, a 411) would otherwise
leave a trickling client connected. It is uvicorn's h11 protocol, the one its "auto" picks here
(httptools is not installed), named explicitly so that the class the clock extends is the one
that runs.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from core.serving.api import ApiError

# Set in a request's ASGI scope when its body timed out, so that the metrics count it as a 408.
TIMED_OUT = "apps.read_timed_out"


def protocol(seconds: float) -> type[H11Protocol]:
    """The protocol class to give `uvicorn.Config(http=...)`, its reads bounded by `seconds`."""
    return type("ReadTimeoutProtocol", (ReadTimeoutProtocol,), {"read_timeout": seconds})


class ReadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a read clock: one timer per connection, armed for the head
    while the client owes a request and for the next piece of the body while it owes one."""

    read_timeout = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._timer: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None  # "head", "body" or None (nothing owed)
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch(arrived=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # on a keep-alive connection, the next request's head is owed
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _watch(self, arrived: bool = False) -> None:
        """Arms, re-arms or disarms the clock for what the client owes now. A head's clock runs
        from when it became owed, whatever pieces of it arrive; a body's restarts with each piece."""
        state = self.conn.their_state
        owed = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if owed is None or self.transport.is_closing():
            self._disarm()
        elif owed != self._waiting_for or (arrived and owed == "body"):
            self._disarm()
            self._timer = self.loop.call_later(self.read_timeout, self._expired)
        self._waiting_for = owed

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._waiting_for = None

    def _expired(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self._waiting_for == "body" and self.flow.read_paused:
            # uvicorn stopped reading because the application has not taken what came: not the client's wait.
            self._timer = self.loop.call_later(self.read_timeout, self._expired)
            return
        cycle = self.cycle
        if self._waiting_for == "body" and cycle is not None and not cycle.response_complete:
            cycle.scope[TIMED_OUT] = True  # type: ignore[literal-required]
            if not cycle.response_started:
                self._send_408()
            # The application's receive() now answers a disconnect, and what it sends is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
        self._disarm()
        self.transport.close()

    def _send_408(self) -> None:
        message = f"The request's body did not arrive: nothing came for {self.read_timeout:g} s."
        self._send_error(ApiError(408, message, "body", "timeout"), b"Request Timeout")

    def send_400_response(self, msg: str) -> None:
        """h11's refusal of a request it cannot parse (a Content-Length that is no number, a
        malformed header), OpenAI-shaped like every other error instead of uvicorn's plain text."""
        message = f"{msg.rstrip('.')}: a malformed request line or header (a Content-Length must be a number)."
        self._send_error(ApiError(400, message, None), b"Bad Request")
        self.transport.close()

    def _send_error(self, error: ApiError, reason: bytes) -> None:
        response = error.response({"connection": "close"})
        headers = self.server_state.default_headers + response.raw_headers
        for event in (
            h11.Response(status_code=error.status, headers=headers, reason=reason),
            h11.Data(data=response.body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
