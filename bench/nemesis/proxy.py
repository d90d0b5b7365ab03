#!/usr/bin/env python3
"""A TCP proxy per directed cluster link, whose links the nemesis faults on command.

Run by nemesis.py as a child process (its own interpreter, so that the pika clients' threads
never hold the GIL in the path of cluster traffic):

    python3 proxy.py --link 1,2,127.0.0.1:25673 --link 2,1,127.0.0.1:25672 ...

Each --link FROM,TO,TARGET listens on 127.0.0.1:<a free port> and forwards every connection
to TARGET (node TO's real --cluster-listen). Node FROM is given that port as node TO's address
in its --peers, so the link FROM->TO carries exactly the connections node FROM dials to node
TO: its raft lane, its data lane and its snapshot lanes to TO (each lane is one way for data:
the bytes from TO back to FROM on them are only the handshake answer and snapshot acks).
Once bound, the proxy prints one line `ready {"FROM,TO": port, ...}` on stdout.

Commands, one JSON object a line on stdin, each answered `ok` (or `error ...`) on stdout:

    {"links": [[1, 2], [2, 1]], "mode": "blackhole"}
    {"links": [[1, 3]], "mode": "delay", "delay_ms": 150}

Modes of a link (applied to its open connections and to the ones accepted later):
- pass: bytes are forwarded as they come.
- blackhole: connections stay open; bytes are read and dropped in both directions (a new
  connection is accepted and never reaches TO). A stream that lost bytes cannot go on
  (TCP never delivers a gap), so when the link leaves blackhole its connections that dropped
  bytes are closed with RST, as the kernel would after its retransmission timeout.
- stall: nothing is read in either direction: the senders' buffers fill and they block
  (backpressure), and bytes flow again, none lost, when the link leaves stall.
- reset: every open connection is closed with RST, and new ones are accepted and reset at
  once (the dialer sees a connection reset, as from a refusing host).
- delay: each chunk is forwarded delay_ms after it was read, in order.
EOF on stdin stops the proxy.
"""

import argparse
import asyncio
import json
import socket
import struct
import sys
import time

PASS, BLACKHOLE, STALL, RESET, DELAY = "pass", "blackhole", "stall", "reset", "delay"
MODES = (PASS, BLACKHOLE, STALL, RESET, DELAY)
CHUNK = 65536


def rst(writer):
    """Closes the connection of `writer` with an RST (SO_LINGER 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()


class Conn:
    """One proxied connection: the dialer's side and, unless blackholed at accept, TO's."""

    def __init__(self, link, down_w):
        self.link = link
        self.down_w = down_w  # towards the dialer (node FROM)
        self.up_w = None  # towards node TO
        self.tainted = False  # dropped bytes: must not carry on when healed
        self.closed = False

    def close(self, reset=True):
        if self.closed:
            return
        self.closed = True
        self.link.conns.discard(self)
        for w in (self.down_w, self.up_w):
            if w is None:
                continue
            if reset:
                rst(w)
            else:
                w.close()


class Link:
    """A directed link FROM->TO: its mode, its connections, and a wake-up on mode changes."""

    def __init__(self, src, dst, target):
        self.src, self.dst, self.target = src, dst, target
        self.mode = PASS
        self.delay = 0.0
        self.conns = set()
        self._changed = asyncio.Event()

    async def changed(self):
        await self._changed.wait()

    def set_mode(self, mode, delay_ms=0):
        old = self.mode
        self.mode, self.delay = mode, delay_ms / 1000.0
        if mode == RESET:
            for c in list(self.conns):
                c.close()
        if old == BLACKHOLE and mode != BLACKHOLE:
            for c in [c for c in self.conns if c.tainted]:
                c.close()
        wake, self._changed = self._changed, asyncio.Event()
        wake.set()

    async def serve(self, reader, writer):
        conn = Conn(self, writer)
        if self.mode == RESET:
            rst(writer)
            return
        self.conns.add(conn)
        if self.mode == BLACKHOLE:
            conn.tainted = True
            await self.pump(conn, reader, None)
            return
        host, port = self.target.rsplit(":", 1)
        try:
            up_r, conn.up_w = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5)
        except (OSError, asyncio.TimeoutError):
            conn.close()  # TO is down: the dialer sees its connection reset
            return
        if conn.closed:  # reset while connecting
            rst(conn.up_w)
            return
        await asyncio.gather(self.pump(conn, reader, conn.up_w), self.pump(conn, up_r, writer))

    async def pump(self, conn, reader, writer):
        """Copies reader -> writer under the link's mode until EOF or close, then closes the
        whole connection (both lanes of a node end a session on either side's close)."""
        queue = asyncio.Queue()
        sender = asyncio.ensure_future(self.send(conn, queue, writer))
        try:
            while not conn.closed:
                if self.mode == STALL:
                    await self.changed()
                    continue
                data = await reader.read(CHUNK)
                if not data:
                    break
                if self.mode == BLACKHOLE or writer is None:
                    conn.tainted = True
                    continue
                queue.put_nowait((time.monotonic() + (self.delay if self.mode == DELAY else 0.0), data))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            await queue.put(None)
            await sender
            conn.close(reset=False)

    async def send(self, conn, queue, writer):
        """Writes queued chunks in order, each not before its due time, none while stalled."""
        while True:
            item = await queue.get()
            if item is None or conn.closed:
                return
            due, data = item
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            while self.mode == STALL and not conn.closed:
                await self.changed()
            if conn.closed:
                return
            try:
                writer.write(data)
                await writer.drain()
            except OSError:
                conn.close()
                return


async def control(links):
    """Applies the commands read from stdin; returns at EOF."""
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        try:
            cmd = json.loads(line)
            mode = cmd["mode"]
            if mode not in MODES:
                raise ValueError(f"unknown mode {mode!r}")
            for src, dst in cmd["links"]:
                links[(src, dst)].set_mode(mode, cmd.get("delay_ms", 0))
            answer = "ok"
        except (ValueError, KeyError, TypeError) as e:
            answer = f"error {e!r}"
        print(answer, flush=True)


async def main(specs):
    links, ports = {}, {}
    for spec in specs:
        src, dst, target = spec.split(",", 2)
        link = Link(int(src), int(dst), target)
        server = await asyncio.start_server(link.serve, "127.0.0.1", 0)
        links[(link.src, link.dst)] = link
        ports[f"{link.src},{link.dst}"] = server.sockets[0].getsockname()[1]
    print("ready " + json.dumps(ports), flush=True)
    await control(links)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--link", action="append", required=True, help="FROM,TO,HOST:PORT of TO's cluster listener")
    try:
        asyncio.run(main(p.parse_args().link))
    except KeyboardInterrupt:
        pass
