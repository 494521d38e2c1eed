"""The daemon's end of the socket: ``kvstore serve``.

- :mod:`~kvstore.daemon.server.daemon`: :class:`~kvstore.daemon.server.daemon.DaemonServer`, which listens, opens
  a shelf per layout and runs it all; :mod:`~kvstore.daemon.server.socketfile` (its socket file),
  :mod:`~kvstore.daemon.server.http` and :mod:`~kvstore.daemon.server.metrics` (``/metrics``),
  :mod:`~kvstore.daemon.server.events` (its KV events for a router).
- :mod:`~kvstore.daemon.server.session`: one connection, request by request; :mod:`~kvstore.daemon.server.peer`
  (the process at its other end).
- :mod:`~kvstore.daemon.server.backend`: the tiers and the clients' slot holds (:mod:`~kvstore.daemon.server.holds`),
  the write-behind (:mod:`~kvstore.daemon.server.writer`), the remote tier (:mod:`~kvstore.daemon.server.remote_link`);
  also run in-process by :mod:`kvstore.lower.local`.
- Layouts: :mod:`~kvstore.daemon.server.shelves` (one backend per layout), :mod:`~kvstore.daemon.server.layout_dirs`
  (where each keeps its disk tier), :mod:`~kvstore.daemon.server.dormant` (the layouts not open).
- Bounds: :mod:`~kvstore.daemon.server.admission`, :mod:`~kvstore.daemon.server.tenancy`,
  :mod:`~kvstore.daemon.server.inflight`.

Imports :mod:`kvstore.daemon.wire`, never :mod:`kvstore.daemon.client`.
"""
