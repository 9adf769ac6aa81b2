"""A TCP relay between a client and a real server, to drop that one client's connections on purpose (no tests here).

`cut` resets every connection through it at once, as a NATS node's death resets its clients' connections, while
the server and its other clients go on; `refuse` closes the listening port (a connect attempt is refused) until
`accept` opens it again on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib


class TcpRelay:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()  # both ends of every connection through it
        self._pipes: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def accept(self) -> None:
        """Listen (again, on the same port once it has one)."""
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def refuse(self) -> None:
        """Stop listening: connect attempts are refused until `accept`."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def cut(self) -> int:
        """Reset every connection through the relay (both ends); returns how many client connections there were."""
        writers = list(self._open)
        for writer in writers:
            writer.transport.abort()
        self._open.clear()
        return len(writers) // 2

    async def close(self) -> None:
        await self.refuse()
        self.cut()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        self._open.update((writer, up_writer))
        pipes = [asyncio.create_task(self._pipe(reader, up_writer)), asyncio.create_task(self._pipe(up_reader, writer))]
        self._pipes.update(pipes)
        try:
            await asyncio.gather(*pipes, return_exceptions=True)
        finally:
            self._pipes.difference_update(pipes)
            for end in (writer, up_writer):
                self._open.discard(end)
                end.transport.abort()

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        sink.transport.abort()  # one direction ended: the other goes with it, as a dead peer's would
