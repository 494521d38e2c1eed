"""The lower-tier stack: the tiers below the GPU (host, disk, remote) built from config and composed.

- :mod:`kvstore.lower.build`: the one place that builds tiers from a config, each with the eviction order
  the placement policy (``policy.placement``) gives it. The embedded store, the daemon and every connector
  build theirs here.
- :mod:`kvstore.lower.local`: the host tier in front of the disk tier (and the remote tier) in one process,
  run by the same code that runs them inside the daemon, for the engine adapters' embedded mode.
- :mod:`kvstore.lower.remote_write`: the remote tier's write policy (``remote.write``), the one owner of which
  groups go remote and when, used by the embedded store (:mod:`kvstore.store.remote_writer`) and the daemon
  (:mod:`kvstore.daemon.server.remote_link`), each giving only how it finds a group and reads its blocks.
- :mod:`kvstore.lower.write_policy`: when a block is due to go down (``policy.write``), for the embedded store
  and the daemon alike.
"""
