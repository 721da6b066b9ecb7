"""The socket `orchard serve` (and deploy/serve.py) listens on turns Nagle off per connection.

With Nagle on, a kept-alive client's next request waited ~40 ms for a delayed ACK before
its first streamed token; asyncio disables Nagle only on sockets whose proto is TCP.
"""

from __future__ import annotations

import asyncio
import socket

from orchard.cluster.cli.serve import bind


def test_connections_accepted_on_the_serve_socket_have_nodelay():
    async def accepted_nodelay() -> int:
        sock = bind("127.0.0.1", 0)
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                seen.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        port = sock.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(seen, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0
