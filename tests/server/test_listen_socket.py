"""The server's listening socket (`launch.bind`): every connection accepted on it has Nagle's
algorithm off, so a response's writes after its first (a JSON body after its headers, each SSE event)
leave at once instead of waiting for the client's delayed ACK on a kept-alive connection."""

from __future__ import annotations

import asyncio
import socket

from tokenmill.server.launch import bind


def test_connections_accepted_on_the_bound_socket_send_without_delay():
    async def accept_one() -> list[int]:
        seen: list[int] = []
        accepted = asyncio.Event()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                accepted.set()
                transport.close()

        listener = bind("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)  # as uvicorn serves it
        _, writer = await asyncio.open_connection("127.0.0.1", listener.getsockname()[1])
        await asyncio.wait_for(accepted.wait(), 10)
        writer.close()
        server.close()
        await server.wait_closed()
        return seen

    assert len(nodelay := asyncio.run(accept_one())) == 1 and nodelay[0] != 0
