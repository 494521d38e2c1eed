"""Run the ``soak`` suite; the same as ``kvstore bench soak`` (try ``--help``, ``--minutes N``, ``--clients N``).

The suite's code lives in ``kvstore/bench/soak.py`` so the installed ``kvstore`` command has it too.
"""

import sys

from kvstore.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "soak", *sys.argv[1:]]))
