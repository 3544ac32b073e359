"""``python -m benchmarks.peers [...]`` runs the benchmark; ``python -m benchmarks.peers report X.json``
rewrites the table and the figure from a result."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if argv[:1] == ["report"]:
        # Deferred import: the report needs neither torch nor our engine (run.py imports both).
        from benchmarks.peers.report import main as report_main

        return report_main(argv[1:])
    # Deferred heavy import (torch, via the model table): the report subcommand does without it.
    from benchmarks.peers.run import main as run_main

    return run_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
