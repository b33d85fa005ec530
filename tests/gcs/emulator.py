"""Run gcp-storage-emulator with generation preconditions (preconditions.py) on a port:
``python tests/gcs/emulator.py PORT``. The tests start it as a subprocess, not a thread: pyarrow's
GcsFileSystem keeps the GIL while it waits for some answers, so a server in the reading process
could never answer it."""
import logging
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from gcp_storage_emulator.server import create_server
    from tests.gcs.preconditions import install
    logging.disable(logging.CRITICAL)  # it logs every request, and every 404 as an error
    install()
    create_server("127.0.0.1", int(sys.argv[1]), in_memory=True).run()
