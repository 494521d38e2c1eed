"""The engine's end of the daemon socket: what an engine process imports to use a ``kvstore serve`` daemon.

- :mod:`~kvstore.daemon.client.connection`: :class:`~kvstore.daemon.client.connection.DaemonClient`, a blocking,
  thread-safe connection (handshake, requests, reconnection, deadlines, the circuit breaker).
- :mod:`~kvstore.daemon.client.tier`: :class:`~kvstore.daemon.client.tier.DaemonTier`, the daemon as a lower tier
  of the engine's store (shared memory for a local client, the bytes inline over TCP).

Imports :mod:`kvstore.daemon.wire`, never :mod:`kvstore.daemon.server`.
"""
