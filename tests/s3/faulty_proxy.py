"""A tiny HTTP proxy in front of a test object-store server (tests/s3's S3, tests/gcs's GCS) that
fails chosen requests the way a store does under load: ``503`` (throttling: S3's SlowDown body),
``500 InternalError``, a connection closed without an answer (``reset``: the request never
reached the store), or one closed after the store handled it (``lost``: applied, its answer
lost); and ``403``/``401``, permanent refusals (GCS's JSON error bodies). Requests are numbered from 1 as
they arrive; ``faults`` maps a number to its fault, everything else is forwarded unchanged (the
Host header too, so signatures hold)."""
from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

BODIES = {
    401: b'{"error": {"code": 401, "message": "Invalid Credentials", "errors": [{"reason": "authError"}]}}',
    403: b'{"error": {"code": 403, "message": "batchrun-test does not have storage.objects.create access", '
         b'"errors": [{"reason": "forbidden", "message": "no access"}]}}',
    503: b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
         b'<Message>Please reduce your request rate.</Message></Error>',
    500: b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
         b'<Message>We encountered an internal error. Please try again.</Message></Error>',
}


class FaultyProxy:
    def __init__(self, upstream: str, faults: dict[int, str] | None = None):
        self.upstream = urlparse(upstream)
        self.faults = dict(faults or {})
        self.count = 0
        self.injected: list[tuple[int, str, str]] = []  # (number, fault, "METHOD path")
        self._mu = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy._mu:
                    proxy.count += 1
                    fault = proxy.faults.get(proxy.count)
                    if fault:
                        proxy.injected.append((proxy.count, fault, f"{self.command} {self.path}"))
                if fault == "reset":
                    self.close_connection = True
                    self.connection.close()
                    return
                if fault in ("503", "500", "403", "401"):
                    payload = BODIES[int(fault)] if self.command != "HEAD" else b""
                    self.send_response(int(fault))
                    self.send_header("Content-Type", "application/json" if fault in ("403", "401") else "application/xml")
                    self.send_header("Content-Length", str(len(BODIES[int(fault)])))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                if fault == "lost":
                    conn.close()
                    self.close_connection = True
                    self.connection.close()
                    return
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length or "0")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FaultyProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
