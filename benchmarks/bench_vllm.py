"""Run the ``vllm`` suite; the same as ``kvstore bench vllm`` (try ``--help``, ``--quick``, ``--out DIR``).

The suite's code lives in ``kvstore/bench/vllm.py`` so the installed ``kvstore`` command has it too.
"""

import sys

from kvstore.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "vllm", *sys.argv[1:]]))
