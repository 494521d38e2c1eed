"""Login by challenge-response: the token never crosses the wire, a captured login cannot be replayed.

::

    client                                   daemon
    CHALLENGE  ───────────────────────────►  nonce = 32 random bytes (one per connection)
               ◄───────────────────────────  nonce
    HELLO(proof = HMAC-SHA256(token, LOGIN_CONTEXT ‖ nonce ‖ transport ‖ fingerprint ‖ want_shm ‖ name))
                                             proof checked against every known token in constant time

The proof binds the nonce (so it is worthless on any other connection) and
what the HELLO asks for (layout, transport, shared memory, name), so none of
them can be altered in flight. Pure functions; the daemon keeps the nonce.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable

NONCE_BYTES = 32
PROOF_BYTES = 32
LOGIN_CONTEXT = b"kvstore-login-v2\x00"


def new_nonce() -> bytes:
    """A fresh challenge (cryptographically random)."""
    return secrets.token_bytes(NONCE_BYTES)


def login_proof(token: str, nonce: bytes, transport: str, fingerprint: bytes, want_shm: bool, client_name: str) -> bytes:
    """What a client holding ``token`` answers to ``nonce`` for a HELLO with these fields."""
    msg = b"".join([
        LOGIN_CONTEXT, nonce, transport.encode(), b"\x00", fingerprint, bytes([int(want_shm)]), client_name.encode(),
    ])
    return hmac.new(token.encode(), msg, hashlib.sha256).digest()


def token_for_proof(proof: bytes, tokens: Iterable[str], nonce: bytes, transport: str, fingerprint: bytes,
                    want_shm: bool, client_name: str) -> str | None:
    """The token among ``tokens`` that produced ``proof``, or ``None``.

    Every token is tried (no early exit) and compared with :func:`hmac.compare_digest`,
    so the time taken says nothing about which token, or how much of one, matched.
    """
    found: str | None = None
    for token in tokens:
        expected = login_proof(token, nonce, transport, fingerprint, want_shm, client_name)
        if hmac.compare_digest(expected, proof) and found is None:
            found = token
    return found
