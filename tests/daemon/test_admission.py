"""Login proofs, the failed-login lockout, connection caps and tenant namespaces, in process (no daemon)."""

from __future__ import annotations

from kvstore.daemon.server.admission import ConnectionLimits, LoginThrottle, Peer
from kvstore.daemon.wire.auth import login_proof, new_nonce, token_for_proof
from kvstore.daemon.server.tenancy import Tenant, TenantCounters

FP = b"f" * 16


def test_proof_binds_token_nonce_and_every_hello_field() -> None:
    nonce = new_nonce()
    assert len(nonce) == 32 and nonce != new_nonce()
    proof = login_proof("tok-b", nonce, "tcp", FP, False, "engine")
    tokens = ["tok-a", "tok-b", "tok-c"]
    assert token_for_proof(proof, tokens, nonce, "tcp", FP, False, "engine") == "tok-b"
    for changed in [(new_nonce(), "tcp", FP, False, "engine"), (nonce, "unix", FP, False, "engine"),
                    (nonce, "tcp", b"g" * 16, False, "engine"), (nonce, "tcp", FP, True, "engine"),
                    (nonce, "tcp", FP, False, "other")]:
        assert token_for_proof(proof, tokens, *changed) is None
    assert token_for_proof(proof, ["tok-a"], nonce, "tcp", FP, False, "engine") is None


def test_throttle_locks_a_peer_after_max_failures_for_the_window() -> None:
    now = [100.0]
    throttle = LoginThrottle(3, 60.0, clock=lambda: now[0])
    bad, other = Peer("tcp", "tcp:10.0.0.1", None), Peer("tcp", "tcp:10.0.0.2", None)
    for _ in range(2):
        throttle.failed(bad)
    assert throttle.locked_for(bad) == 0.0
    now[0] += 10
    throttle.failed(bad)
    assert throttle.locked_for(bad) == 50.0  # the oldest counted failure leaves the window in 50 s
    assert throttle.locked_for(other) == 0.0
    now[0] += 50
    assert throttle.locked_for(bad) == 0.0  # two failures left in the window: under the limit again
    now[0] += 10
    assert throttle.locked_for(bad) == 0.0 and not throttle._failures


def test_connection_limits_per_peer_total_and_tcp_share() -> None:
    limits = ConnectionLimits(8, 4)
    tcp1, tcp2, tcp3 = (Peer("tcp", f"tcp:10.0.0.{i}", None) for i in (1, 2, 3))
    local = Peer("unix", "uid:7", 42)
    assert [limits.admit(tcp1) for _ in range(4)] == [None] * 4
    assert "peer tcp:10.0.0.1 has 4 connections" in str(limits.admit(tcp1))
    assert [limits.admit(tcp2) for _ in range(3)] == [None] * 3
    assert "7 TCP connections" in str(limits.admit(tcp3))  # 1/8 kept for local clients
    assert limits.admit(local) is None
    assert "8 connections, its limit (daemon.max_connections)" in str(limits.admit(local))
    limits.leave(tcp1)
    assert limits.admit(tcp3) is None
    assert (limits.total, limits.tcp, limits.refused) == (8, 7, 3)


def test_tenant_namespaces_are_disjoint_and_stable() -> None:
    a, a_again, b = Tenant.from_salt("salt-a"), Tenant.from_salt("salt-a"), Tenant.from_salt("salt-b")
    keys = [bytes([i]) * 32 for i in range(4)]
    assert a.keys(keys) == a_again.keys(keys)
    assert not set(a.keys(keys)) & set(b.keys(keys)) and not set(a.keys(keys)) & set(keys)
    assert all(len(k) == 32 for k in a.keys(keys)) and a.label != b.label


def test_tenant_counters_add_and_snapshot() -> None:
    c = TenantCounters()
    c.add(requests=2, blocks_found=5)
    assert c.as_dict() == {"requests": 2, "keys_probed": 0, "blocks_found": 5, "blocks_missed": 0,
                           "blocks_stored": 0, "blocks_deleted": 0}
