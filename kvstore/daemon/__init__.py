"""The sidecar daemon (``kvstore serve``): one host-RAM + NVMe cache shared by the engines on a host.

Both ends of its socket, apart:

- :mod:`kvstore.daemon.wire`: the protocol both ends speak (frames, typed messages, login, the layout check).
- :mod:`kvstore.daemon.client`: the engine's end: :class:`~kvstore.daemon.client.connection.DaemonClient` (the
  connection) and :class:`~kvstore.daemon.client.tier.DaemonTier` (the daemon as a lower tier of an engine's store).
- :mod:`kvstore.daemon.server`: the daemon's end: the server, one session per connection, the backend that keeps
  the tiers and the clients' slot holds, and what bounds them.

The client side does not import the server side, nor the server side the client side; both import the wire
(``tests/test_import_contract.py``).
"""
