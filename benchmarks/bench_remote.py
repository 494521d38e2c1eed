"""Run the ``remote`` suite; the same as ``kvstore bench remote`` (try ``--help``, ``--quick``, ``--out DIR``).

The suite's code lives in ``kvstore/bench/remote.py`` so the installed ``kvstore`` command has it too.
"""

import sys

from kvstore.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "remote", *sys.argv[1:]]))
