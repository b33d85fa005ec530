"""Run gcp-storage-emulator with generation preconditions (preconditions.py) on a port:
``python tests/gcs/emulator.py PORT``. The tests start it as a subprocess, not a thread: pyarrow's
GcsFileSystem keeps the GIL while it waits for some answers, so a server in the reading process
could never answer it. Requests are served on threads (the emulator's own server answers one at
a time, so a client that leaves a download unread would stall every other); preconditions.py
keeps the handlers themselves one at a time."""
import logging
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from functools import partial
    from http.server import ThreadingHTTPServer
    from gcp_storage_emulator.server import RequestHandler
    from gcp_storage_emulator.storage import Storage
    from tests.gcs.preconditions import install
    logging.disable(logging.CRITICAL)  # it logs every request, and every 404 as an error
    install()
    httpd = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), partial(RequestHandler, Storage(use_memory_fs=True)))
    httpd.daemon_threads = True
    httpd.serve_forever()
