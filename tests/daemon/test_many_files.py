"""A client in a process with more than 1,024 open files (inference servers routinely have that many).

``select.select`` refuses descriptors numbered 1024 and above, so a client
checking its socket with it raised ``ValueError`` on get, put, probe and
flush once the daemon's socket landed at such a number. The client runs in
its own process here, which opens 1,100 files before it connects.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from daemonlib import REPO, cleanup, short_tmpdir, start_daemon, write_config
from kvstore.daemon.client.connection import IDLE_CHECK_S

CLIENT = textwrap.dedent("""
    import json, os, resource, sys, time
    sys.path.insert(0, {daemon_tests!r})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 4096), hard), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    from daemonlib import Daemon, block_for, keys_for
    from kvstore.daemon.client.connection import DaemonClient
    from kvstore.daemon.client.tier import DaemonTier
    from daemonlib import LAYOUT, empty_blocks
    client = DaemonClient(LAYOUT, socket_path={socket!r})
    client.connect(10)
    tier = DaemonTier(LAYOUT, client)
    keys = keys_for(4, seed=77)
    idle = {idle}  # the client checks an idle connection for a daemon that went away before each request
    time.sleep(idle)
    out = {{"fd": client._sock.fileno(), "put": tier.put(keys, [block_for(k) for k in keys])}}
    time.sleep(idle)
    tier.flush()
    time.sleep(idle)
    out["prefix"] = tier.contains_prefix(keys)
    dests = empty_blocks(4)
    time.sleep(idle)
    out["get"] = tier.get(keys, dests)
    out["bytes_ok"] = all(bool((d == block_for(k)).all()) for d, k in zip(dests, keys))
    tier.close()
    print(json.dumps(out))
""")


def test_a_client_with_more_than_1024_open_files_gets_puts_probes_and_flushes() -> None:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(write_config(root))
        code = CLIENT.format(daemon_tests=str(REPO / "tests" / "daemon"), socket=d.socket_path, idle=IDLE_CHECK_S + 0.2)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert res.returncode == 0, res.stderr[-3000:]
        out = json.loads(res.stdout.strip().splitlines()[-1])
        assert out["fd"] >= 1024  # the case select() cannot handle
        assert out["put"] == [True] * 4 and out["prefix"] == 4 and out["get"] == [True] * 4 and out["bytes_ok"]
    finally:
        cleanup(d, root)
