"""The sidecar daemon (``kvstore serve``): one host-RAM + NVMe cache shared by the engines on a host.

``frames``/``messages`` define the wire protocol, ``session`` serves one
connection, ``backend`` keeps the tiers and the clients' slot holds, ``server`` runs it all,
``client`` is what engines use, through ``tier`` (``DaemonTier``: the daemon as a lower tier of their store).
"""
