"""Tenants and logins against a live daemon.

Item 4: the daemon namespaces every key by the tenant its token maps to, so a
tenant that sends another tenant's (or a local engine's) exact keys reaches
nothing of theirs. Item 5: the login is a challenge-response; a captured HELLO
is worthless on another connection, a wrong token fails, and a peer that keeps
failing is refused at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from daemonlib import (
    LAYOUT, Daemon, block_for, cleanup, empty_blocks, expect_error, free_port, keys_for, raw_tcp, raw_unix, read_reply,
    maps_arena, short_tmpdir, start_daemon, write_config,
)
from kvstore.daemon.wire import messages as m
from kvstore.daemon.wire.auth import login_proof
from kvstore.daemon.client.connection import DaemonClient, DaemonUnavailable
from kvstore.daemon.wire.frames import DaemonError, ErrorCode, Op, encode_frame
from kvstore.daemon.client.tier import DaemonTier

TOKEN = "admin-token"
A_TOKEN, B_TOKEN = "token-of-tenant-a", "token-of-tenant-b"
SALTS = {A_TOKEN: "salt-a", B_TOKEN: "salt-b"}


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    root = short_tmpdir()
    d = None
    try:
        cfg = write_config(root, daemon={"tcp_host": "127.0.0.1", "tcp_port": free_port(), "token": TOKEN,
                                         "tenant_salts": SALTS})
        d = start_daemon(cfg)
        yield d
    finally:
        cleanup(d, root)


def tcp_tier(d: Daemon, token: str, name: str) -> DaemonTier:
    assert d.tcp is not None
    host, port = d.tcp.rsplit(":", 1)
    client = DaemonClient(LAYOUT, tcp=(host, int(port)), token=token, client_name=name)
    client.connect(10)
    return DaemonTier(LAYOUT, client)


def other_block(key: bytes) -> torch.Tensor:
    """Bytes that differ from :func:`block_for` (what an attacker would plant)."""
    return 255 - block_for(key)


def got(tier: DaemonTier, keys: list[bytes]) -> list[torch.Tensor | None]:
    dests = empty_blocks(len(keys))
    return [d if ok else None for ok, d in zip(tier.get(keys, dests), dests)]


def test_tenant_reaches_nothing_of_another_tenant_or_of_local_clients(daemon: Daemon) -> None:
    local = daemon.tier(token=None, client_name="local engine")
    tenant_b = tcp_tier(daemon, B_TOKEN, "tenant b")
    tenant_a = tcp_tier(daemon, A_TOKEN, "tenant a")
    local_keys, b_keys, planted = keys_for(8, seed=401), keys_for(8, seed=402), keys_for(8, seed=403)
    assert all(local.put(local_keys, [block_for(k) for k in local_keys]))
    assert all(tenant_b.put(b_keys, [block_for(k) for k in b_keys]))
    for victim in (local_keys, b_keys):  # A sends the victims' exact keys
        assert tenant_a.contains_prefix(victim) == 0
        assert got(tenant_a, victim) == [None] * 8
        assert tenant_a.delete(victim) == 0
        assert all(tenant_a.put(victim, [other_block(k) for k in victim]))  # lands in A's namespace only
    assert all(g is not None and torch.equal(g, other_block(k)) for g, k in zip(got(tenant_a, b_keys), b_keys))
    # the victims still have exactly their own bytes
    assert all(g is not None and torch.equal(g, block_for(k)) for g, k in zip(got(tenant_b, b_keys), b_keys))
    assert all(g is not None and torch.equal(g, block_for(k)) for g, k in zip(got(local, local_keys), local_keys))
    # a block a tenant plants under a key a local engine computes is never served to that engine
    assert all(tenant_a.put(planted, [other_block(k) for k in planted]))
    assert local.contains_prefix(planted) == 0 and got(local, planted) == [None] * 8
    assert tenant_b.contains_prefix(planted) == 0
    # and B cannot delete what A stored either
    assert tenant_b.delete(planted) == 0 and tenant_a.contains_prefix(planted) == 8
    for t in (local, tenant_a, tenant_b):
        t.close()


def test_tenant_gets_its_salt_and_no_shared_memory(daemon: Daemon) -> None:
    # A tenant logging in on the local socket still gets no shared memory: the arena holds every namespace.
    client = DaemonClient(LAYOUT, socket_path=daemon.socket_path, token=A_TOKEN, client_name="tenant a, local")
    hello = client.connect(10)
    assert hello.salt == b"salt-a" and hello.shm_name is None and client.arena is None
    with pytest.raises(DaemonError, match="GET_SHM: shared memory is only for untenanted local clients"):
        client.keys_request(Op.GET_SHM, keys_for(1))
    client.close()
    admin = DaemonClient(LAYOUT, socket_path=daemon.socket_path, token=TOKEN)
    hello = admin.connect(10)
    assert hello.salt is None and hello.shm_name is None and admin.arena is None  # untenanted, yet no segment
    admin.close()


def test_with_tenants_no_local_process_can_map_a_tenants_blocks(daemon: Daemon) -> None:
    """A local process with access to the socket read, altered and got persisted a TCP
    tenant's blocks through the shared segment every local client maps, and killed the daemon by
    truncating it. With tenants configured the host tier is the daemon's private memory: there is no
    segment to open, and every client is served inline."""
    tenant = DaemonClient(LAYOUT, socket_path=daemon.socket_path, token=A_TOKEN, client_name="tenant a")
    tenant.connect(10)
    tier_a = DaemonTier(LAYOUT, tenant)
    keys = keys_for(16, seed=930)
    assert tier_a.put(keys, [block_for(k) for k in keys]) == [True] * 16
    assert not maps_arena(daemon.proc.pid)  # the daemon maps no shared arena: nothing a client could be given
    local = DaemonClient(LAYOUT, socket_path=daemon.socket_path, token=TOKEN)  # asks for shared memory
    assert local.connect(10).shm_name is None and local.arena is None
    with pytest.raises(DaemonError, match="GET_SHM: shared memory is only for untenanted local clients"):
        local.keys_request(Op.GET_SHM, keys)
    local.close()
    dests = empty_blocks(16)
    assert tier_a.get(keys, dests) == [True] * 16
    assert all(torch.equal(d, block_for(k)) for d, k in zip(dests, keys))
    tier_a.close()
    assert "the host tier is private memory" in daemon.log.read_text()



def test_tenant_stats_show_only_its_own_counters(daemon: Daemon) -> None:
    tenant_a = tcp_tier(daemon, A_TOKEN, "tenant a")
    before = tenant_a.client.stats()
    assert set(before) == {"tenant", "daemon"}
    assert set(before["daemon"]) == {"model_id", "bytes_per_block"}
    keys = keys_for(3, seed=404)
    assert all(tenant_a.put(keys, [block_for(k) for k in keys]))
    assert got(tenant_a, keys + keys_for(2, seed=405))[:3] != [None] * 3
    after = tenant_a.client.stats()["tenant"]
    assert after["blocks_stored"] - before["tenant"]["blocks_stored"] == 3
    assert after["blocks_found"] - before["tenant"]["blocks_found"] == 3
    assert after["blocks_missed"] - before["tenant"]["blocks_missed"] == 2
    tenant_a.close()
    full = daemon.tier(token=None).client.stats()  # an untenanted local client sees the whole daemon
    assert "host" in full and len(full["daemon"]["tenants"]) == 2


def challenge(s) -> bytes:  # noqa: ANN001 - a socket
    s.sendall(encode_frame(Op.CHALLENGE, 1))
    reply = read_reply(s)
    assert reply is not None and reply[0] == Op.CHALLENGE | 0x8000
    return m.decode_challenge(reply[1])


def test_captured_hello_cannot_be_replayed(daemon: Daemon) -> None:
    with raw_tcp(daemon) as s:
        nonce = challenge(s)
        proof = login_proof(TOKEN, nonce, "tcp", LAYOUT.fingerprint, False, "victim")
        captured = encode_frame(Op.HELLO, 2, m.encode_hello(m.Hello(LAYOUT.fingerprint, proof, "victim", False)))
        assert TOKEN.encode() not in captured  # the token never crosses the wire
        s.sendall(captured)
        reply = read_reply(s)
        assert reply is not None and reply[0] == Op.HELLO | 0x8000  # the genuine login works
    with raw_tcp(daemon) as s:  # replayed after a fresh challenge
        assert challenge(s) != nonce
        s.sendall(captured)
        assert "wrong token" in expect_error(s, ErrorCode.UNAUTHORIZED, closed=True)
    with raw_tcp(daemon) as s:  # replayed without asking for a challenge
        s.sendall(captured)
        assert "needs a CHALLENGE first" in expect_error(s, ErrorCode.UNAUTHORIZED, closed=True)


def test_wrong_token_fails_and_right_token_works(daemon: Daemon) -> None:
    assert daemon.tcp is not None
    host, port = daemon.tcp.rsplit(":", 1)
    wrong = DaemonClient(LAYOUT, tcp=(host, int(port)), token="not-the-token")
    with pytest.raises(DaemonError, match="UNAUTHORIZED: HELLO: wrong token"):
        wrong.connect(10)
    right = DaemonClient(LAYOUT, tcp=(host, int(port)), token=TOKEN, client_name="right")
    assert right.connect(10).salt is None
    right.close()


@pytest.fixture()
def strict_daemon() -> Iterator[Daemon]:
    root = short_tmpdir()
    d = None
    try:
        cfg = write_config(root, daemon={"tcp_host": "127.0.0.1", "tcp_port": free_port(), "token": TOKEN,
                                         "max_login_failures": 3, "login_lockout_s": 600})
        d = start_daemon(cfg)
        yield d
    finally:
        cleanup(d, root)


def test_repeated_failed_logins_lock_the_peer_out(strict_daemon: Daemon) -> None:
    d = strict_daemon
    for i in range(3):
        with raw_tcp(d) as s:
            proof = login_proof(f"guess-{i}", challenge(s), "tcp", LAYOUT.fingerprint, False, "")
            s.sendall(encode_frame(Op.HELLO, 2, m.encode_hello(m.Hello(LAYOUT.fingerprint, proof, "", False))))
            expect_error(s, ErrorCode.UNAUTHORIZED, closed=True)
    t0 = time.monotonic()
    with raw_tcp(d) as s:  # refused at once, before it can send anything: even the right token gets nowhere
        message = expect_error(s, ErrorCode.UNAVAILABLE, closed=True)
    assert time.monotonic() - t0 < 2.0
    assert "too many failed logins from tcp:127.0.0.1" in message
    host, port = d.tcp.rsplit(":", 1)  # type: ignore[union-attr]
    with pytest.raises(DaemonUnavailable, match="UNAVAILABLE: connection refused: too many failed logins"):
        DaemonClient(LAYOUT, tcp=(host, int(port)), token=TOKEN).connect(0)
    # another peer (the local socket, another user id namespace) is not locked out
    local = d.tier(token=None, client_name="local")
    assert local.client.stats()["daemon"]["errors"]["UNAUTHORIZED"] == 3
    local.close()
    with raw_unix(d) as s:  # and the local peer's own token login still works
        proof = login_proof(TOKEN, challenge(s), "unix", LAYOUT.fingerprint, False, "")
        s.sendall(encode_frame(Op.HELLO, 2, m.encode_hello(m.Hello(LAYOUT.fingerprint, proof, "", False))))
        reply = read_reply(s)
        assert reply is not None and reply[0] == Op.HELLO | 0x8000
