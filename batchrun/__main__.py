"""Console entry (`batchrun ...`, `python -m batchrun ...`).

Signal handlers come first, before click/pyarrow/torch are imported, so SIGTERM/SIGINT at any
moment of start-up exits 130 with one line instead of 143 (no message) or click's "Aborted!".
"""
import sys

from batchrun.job.interrupt import Interrupted, install_early

INTERRUPTED = 130  # ExitCode.INTERRUPTED (not imported from cli: that would import click first)


def entry(args=None) -> None:
    install_early()
    try:
        from batchrun.cli import main
        main(args)
    except Interrupted as e:
        sys.stderr.write(f"batchrun: error: interrupted ({e}); no partial file was left. Rerun the same "
                         "command (a run resumes after its committed units).\n")
        sys.exit(INTERRUPTED)


if __name__ == "__main__":
    entry()
