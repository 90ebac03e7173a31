"""A static file server on 127.0.0.1 that honours HTTP Range requests and counts bytes served.

It stands in for object storage (S3, GCS, any HTTPS server of cloud-optimised GeoTIFFs) in the
tests and in ``launch/data_benchmark.py --http``: GDAL's ``/vsicurl/`` reads the same way from
it, one ranged GET per run of tiles, so the bytes it serves show what a window read costs.
Path-style S3 requests (``/bucket/key``) work too, with ``AWS_S3_ENDPOINT`` pointing here.

Example::

    with RangeServer('scenes/') as server:
        url = server.url('a.tif')          # http://127.0.0.1:<port>/a.tif
        ...                                 # read windows of url
        print(server.bytes_served, server.requests)
"""
import os
import re
import threading
from email.utils import parsedate_to_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

_RANGE = re.compile(r'^bytes=(\d*)-(\d*)$')


class RangeServer:
    """Serves ``root`` on 127.0.0.1 (an ephemeral port) from a background thread."""

    def __init__(self, root, latency_s=0.0, honour_range=True, stall=False, etag=True, json_alias=None,
                 catch_all=False):
        self.root = os.path.abspath(root)
        # True: a path that is no file gets 200 and a web page, as a catch-all site, a soft-404
        # CDN or a login portal answers.
        self.catch_all = bool(catch_all)
        # 'alias/': a JSON document asked for under it is redirected (302) to the same path without
        # it, anything else there is 404: a catalogue reached through a short link or a DOI.
        self.json_alias = json_alias
        self.etag = bool(etag)  # False: Last-Modified only (whole seconds), as many servers send
        self.latency_s = float(latency_s)
        self.honour_range = bool(honour_range)  # False: a server that always sends the whole file
        self.stall = bool(stall)  # True: accepts connections, never answers (until closed)
        self._closing = threading.Event()
        self.bytes_served = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(('127.0.0.1', 0), self._handler())
        self._httpd.daemon_threads = True
        self._thread = None

    @property
    def port(self):
        return self._httpd.server_address[1]

    def url(self, relpath):
        return f'http://127.0.0.1:{self.port}/{relpath}'

    def reset(self):
        with self._lock:
            self.bytes_served = self.requests = 0

    def _count(self, n):
        with self._lock:
            self.bytes_served += n
            self.requests += 1

    def __enter__(self):
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._closing.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        return False

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = 'HTTP/1.1'  # keep-alive: one connection for many ranges

            def log_message(self, *args):
                pass

            def _redirected(self):
                rel = urlsplit(self.path).path.lstrip('/')
                if not server.json_alias or not rel.startswith(server.json_alias) or not rel.endswith('.json'):
                    return False
                self.send_response(302)
                self.send_header('Location', '/' + rel[len(server.json_alias):])
                self.send_header('Content-Length', '0')
                self.end_headers()
                return True

            def _file(self):
                rel = unquote(urlsplit(self.path).path).lstrip('/')
                if server.json_alias and rel.startswith(server.json_alias):
                    return None
                path = os.path.abspath(os.path.join(server.root, rel))
                if not path.startswith(server.root + os.sep) or not os.path.isfile(path):
                    return None
                return path

            @staticmethod
            def _etag(path):
                st = os.stat(path)
                return f'"{st.st_size:x}-{st.st_mtime_ns:x}"' if server.etag else None

            def _version_headers(self, path):
                # What object storage and web servers send, and what caches key a URL's version to.
                if server.etag:
                    self.send_header('ETag', self._etag(path))
                self.send_header('Last-Modified', self.date_time_string(os.stat(path).st_mtime))

            def _precondition_failed(self, path):
                """Answer 412 where the request's precondition fails (RFC 9110 13.1.1, 13.1.4: If-Match
                by strong comparison; else If-Unmodified-Since), as nginx and object storage do."""
                if_match = self.headers.get('If-Match')
                if if_match is not None:
                    tags = [tag.strip() for tag in if_match.split(',')]
                    ok = '*' in tags or (server.etag and self._etag(path) in tags)
                else:
                    ok = True
                    since = self.headers.get('If-Unmodified-Since')
                    try:
                        ok = not since or int(os.stat(path).st_mtime) <= parsedate_to_datetime(since).timestamp()
                    except (TypeError, ValueError):  # not a date: ignored, as RFC 9110 says
                        pass
                if not ok:
                    self.send_response(412)
                    self.send_header('Content-Length', '0')
                    self.end_headers()
                return not ok

            def _stalled(self):
                if server.stall:
                    server._closing.wait()
                return server.stall

            def _not_found(self):
                if server.catch_all:
                    page = b'<!doctype html><html><body>Welcome! Please sign in.</body></html>'
                    self.send_response(200)
                    self.send_header('Content-Type', 'text/html')
                    self.send_header('Content-Length', str(len(page)))
                    self.end_headers()
                    self.wfile.write(page if self.command == 'GET' else b'')
                    return
                self.send_response(404)
                self.send_header('Content-Length', '0')
                self.end_headers()

            def do_HEAD(self):
                if self._stalled() or self._redirected():
                    return
                path = self._file()
                if path is None:
                    return self._not_found()
                if self._precondition_failed(path):
                    return
                self.send_response(200)
                self.send_header('Content-Length', str(os.path.getsize(path)))
                self._version_headers(path)
                if server.honour_range:
                    self.send_header('Accept-Ranges', 'bytes')
                self.end_headers()
                server._count(0)

            def do_GET(self):
                if self._stalled() or self._redirected():
                    return
                path = self._file()
                if path is None:
                    return self._not_found()
                if self._precondition_failed(path):
                    return
                if server.latency_s:
                    threading.Event().wait(server.latency_s)
                size = os.path.getsize(path)
                start, end = 0, size - 1
                m = _RANGE.match(self.headers.get('Range', '')) if server.honour_range else None
                if m and (m.group(1) or m.group(2)):
                    if m.group(1):
                        start = int(m.group(1))
                        end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
                    else:  # a suffix: the last N bytes
                        start = max(size - int(m.group(2)), 0)
                    if start >= size:
                        self.send_response(416)
                        self.send_header('Content-Range', f'bytes */{size}')
                        self.send_header('Content-Length', '0')
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header('Content-Range', f'bytes {start}-{end}/{size}')
                else:  # no range, or several (not supported): the whole file, as HTTP allows
                    self.send_response(200)
                n = end - start + 1
                self.send_header('Content-Length', str(n))
                self._version_headers(path)
                if server.honour_range:
                    self.send_header('Accept-Ranges', 'bytes')
                self.end_headers()
                # Counted before the bytes go out: once a client has them, the count includes them
                # (counted after, a test could read the count while this thread is still writing).
                server._count(n)
                with open(path, 'rb') as f:
                    f.seek(start)
                    self.wfile.write(f.read(n))

        return Handler
