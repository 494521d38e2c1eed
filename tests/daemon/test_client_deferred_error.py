"""The client against a fake daemon that answers a deferred RELEASE with an error reply.

The error is logged when the client reads it (before the next request's reply),
and the connection stays in step: the next requests get their own replies.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemonlib import LAYOUT, recv_exactly, short_tmpdir
from kvstore.daemon import messages as m
from kvstore.daemon.client import DaemonClient
from kvstore.daemon.frames import HEADER_SIZE, REPLY_BIT, ErrorCode, Op, decode_header, encode_frame

RELEASE_ERRORS = [(int(ErrorCode.NOT_ALLOWED), "no such hold"), (77, "a code this client does not know")]


def _recv(conn: socket.socket, n: int) -> bytes:
    data = recv_exactly(conn, n)
    if data is None:
        raise ConnectionResetError
    return data


def _serve(conn: socket.socket, seen: list[Op]) -> None:
    """Answer HELLO, refuse each RELEASE with the next of RELEASE_ERRORS, answer STATS with its request id."""
    errors = iter(RELEASE_ERRORS)
    with conn:
        while True:
            try:
                header = decode_header(_recv(conn, HEADER_SIZE), 1 << 20)
                _recv(conn, header.length)
            except ConnectionResetError:
                return
            op = Op(header.op)
            seen.append(op)
            if op == Op.HELLO:
                reply = m.encode_hello_reply(m.HelloReply(None, None, LAYOUT.bytes_per_block, 8, 2.0, 1 << 20, 64))
                conn.sendall(encode_frame(op | REPLY_BIT, header.request_id, reply))
            elif op == Op.RELEASE:
                code, message = next(errors)
                payload = code.to_bytes(2, "little") + message.encode()
                conn.sendall(encode_frame(Op.ERROR, header.request_id, payload))
            else:
                conn.sendall(encode_frame(op | REPLY_BIT, header.request_id, m.encode_json({"id": header.request_id})))


@pytest.fixture
def fake_daemon() -> Iterator[tuple[str, list[Op]]]:
    root = short_tmpdir()
    path = str(root / "fake.sock")
    seen: list[Op] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(path)
        srv.listen(1)
        srv.settimeout(10)

        def accept() -> None:
            conn, _ = srv.accept()
            _serve(conn, seen)

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        yield path, seen
    t.join(10)
    Path(path).unlink(missing_ok=True)
    root.rmdir()


def test_error_reply_to_a_deferred_release_is_logged_and_the_connection_stays_in_step(
    fake_daemon: tuple[str, list[Op]], caplog: pytest.LogCaptureFixture
) -> None:
    path, seen = fake_daemon
    client = DaemonClient(LAYOUT, socket_path=path, use_shm=False, timeout_s=10)
    client.connect(5)
    key = b"k" * 32
    caplog.set_level(logging.DEBUG, logger="kvstore.daemon.client")
    client.send_nowait(Op.RELEASE, m.encode_keys([key]))
    client.send_nowait(Op.RELEASE, m.encode_keys([key]))
    # Both error replies are read (in order) before this request's own reply.
    first = m.decode_json(client.request(Op.STATS))
    second = m.decode_json(client.request(Op.STATS))
    assert (first["id"], second["id"]) == (4, 5)  # HELLO 1, RELEASE 2 and 3: each reply matched its request
    assert client.generation == 1  # never reconnected
    refused = [r.getMessage() for r in caplog.records if "deferred RELEASE" in r.getMessage()]
    assert refused == [
        "deferred RELEASE: daemon refused the request: NOT_ALLOWED: no such hold",
        "deferred RELEASE: daemon refused the request: code 77: a code this client does not know",
    ]
    client.close()
    assert seen == [Op.HELLO, Op.RELEASE, Op.RELEASE, Op.STATS, Op.STATS]
