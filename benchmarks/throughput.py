"""End-to-end throughput benchmark: slafload vs the raw Lance scan floor vs slafdb.

The implementation lives in :mod:`slafload.tools.bench` so the ``slafload bench`` command can run it
from an installed package; this script is the README's main command::

    python benchmarks/throughput.py [--cells N] [--no-peers] [--out results.json]
"""

from slafload.tools.bench import main

if __name__ == "__main__":
    main()
