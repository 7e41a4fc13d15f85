"""A real S3 endpoint on 127.0.0.1 for tests and benchmarks: moto's ThreadedMotoServer (the S3 REST API
over HTTP, the same requests s3fs sends to AWS), with server-side counters of what clients sent.

    srv = S3Server().start()             # a free port, bucket "nb-test", AWS_* variables in os.environ
    ... s3fs / the pipeline write to srv.url("archive") ...
    srv.counters()                       # {"put_bytes", "put_requests", "copies", "copy_bytes", "deletes"}
    srv.stop()

Bytes are counted where they arrive: a WSGI middleware around moto's app counts the body bytes the
server reads from every PUT/POST (single PUTs, multipart parts, multipart completions), and every
server-side copy (`x-amz-copy-source`, which is what s3fs sends for `mv`/`copy`) with the size of the
object it copies. Per-request rows (`requests`) let a benchmark split the bytes by key prefix.

Ray workers of a local cluster see the AWS_* variables only if they are in the driver's environment
before `ray.init`, or in its runtime_env (tests/conftest.py passes them).
"""
from __future__ import annotations

import os
import socket
import threading
import urllib.parse
import uuid

BUCKET = "nb-test"


def listening_socket() -> socket.socket:
    """A socket bound to a free port on 127.0.0.1 and listening: the port is ours from now on, even if
    the server starts much later (a port number alone may be taken by then, e.g. by Ray)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    return s


def _moto_server_class():
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    class BoundMotoServer(ThreadedMotoServer):
        """moto's ThreadedMotoServer, serving on a socket bound beforehand (werkzeug's `fd=`)."""

        def __init__(self, sock: socket.socket):
            host, port = sock.getsockname()[:2]
            super().__init__(ip_address=host, port=port, verbose=False)
            self._sock = sock

        def _server_entry(self) -> None:
            app = DomainDispatcherApplication(create_backend_app)
            self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler,
                                       fd=self._sock.fileno())
            self._server_ready_event.set()
            self._server.serve_forever()

    return BoundMotoServer


def aws_env(port: int) -> dict[str, str]:
    """What botocore (and so s3fs) needs to talk to the endpoint instead of AWS."""
    return {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class _CountingInput:
    """wsgi.input that counts what the application reads."""

    def __init__(self, raw, on_read):
        self._raw, self._on_read = raw, on_read

    def read(self, *a):
        b = self._raw.read(*a)
        self._on_read(len(b))
        return b

    def readline(self, *a):
        b = self._raw.readline(*a)
        self._on_read(len(b))
        return b

    def readlines(self, *a):
        lines = self._raw.readlines(*a)
        self._on_read(sum(len(x) for x in lines))
        return lines

    def __iter__(self):
        for line in self._raw:
            self._on_read(len(line))
            yield line


class CountingApp:
    """WSGI middleware: counts request bodies of PUT/POST and server-side copies, per request."""

    def __init__(self, app, size_of):
        self.app = app
        self.size_of = size_of          # (bucket, key) -> size, for copy sources
        self.lock = threading.Lock()
        self.requests: list[dict] = []

    def __call__(self, environ, start_response):
        method = environ.get("REQUEST_METHOD", "")
        path = urllib.parse.unquote(environ.get("PATH_INFO", ""))
        row = {"method": method, "path": path, "query": environ.get("QUERY_STRING", ""), "body_bytes": 0,
               "copy_bytes": 0, "copy": False}
        if method in ("PUT", "POST"):
            def on_read(n):
                row["body_bytes"] += n
            environ["wsgi.input"] = _CountingInput(environ["wsgi.input"], on_read)
            src = environ.get("HTTP_X_AMZ_COPY_SOURCE")
            if src:
                bucket, _, key = urllib.parse.unquote(src).lstrip("/").partition("/")
                row["copy"] = True
                row["copy_bytes"] = self.size_of(bucket, key.split("?", 1)[0])
        with self.lock:
            self.requests.append(row)
        return self.app(environ, start_response)


def _forget_s3_filesystems() -> None:
    """fsspec caches S3FileSystem instances by their arguments, not by the AWS_* environment they read
    the endpoint from: after the environment points at another server, a cached instance would still
    talk to the old one (a second server in the same process, e.g. bench/s3_bytes.py inside the suite)."""
    import s3fs
    s3fs.S3FileSystem.clear_instance_cache()


class S3Server:
    def __init__(self, sock: socket.socket | None = None, bucket: str = BUCKET):
        self.sock = sock or listening_socket()
        self.port = self.sock.getsockname()[1]
        self.bucket = bucket
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = None
        self.app: CountingApp | None = None
        self._saved_env: dict = {}

    # ---- life cycle ------------------------------------------------------------------------------
    def start(self, set_env: bool = True) -> "S3Server":
        import logging
        logging.getLogger("werkzeug").setLevel(logging.ERROR)      # no access-log line per request
        self._server = _moto_server_class()(self.sock)
        self._server.start()
        wsgi = self._server._server           # werkzeug's server: its request handler calls server.app
        self.app = CountingApp(wsgi.app, self._object_size)
        wsgi.app = self.app
        if set_env:
            for k, v in aws_env(self.port).items():
                self._saved_env[k] = os.environ.get(k)
                os.environ[k] = v
            _forget_s3_filesystems()
        self.client().create_bucket(Bucket=self.bucket)
        self.reset()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
            self.sock.close()
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if self._saved_env:
            _forget_s3_filesystems()
        self._saved_env = {}

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ---- clients -----------------------------------------------------------------------------------
    def client(self):
        import boto3
        env = aws_env(self.port)
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_DEFAULT_REGION"])

    def fs(self):
        """A fresh s3fs filesystem on this endpoint (no listing cache carried between tests)."""
        import s3fs
        return s3fs.S3FileSystem(endpoint_url=self.endpoint, key="testing", secret="testing",
                                 skip_instance_cache=True, use_listings_cache=False)

    def url(self, name: str = "x", unique: bool = True) -> str:
        """s3://<bucket>/<name>[-<random>]: a fresh prefix per call, so tests sharing the server never meet."""
        return f"s3://{self.bucket}/{name}-{uuid.uuid4().hex[:8]}" if unique else f"s3://{self.bucket}/{name}"

    def _object_size(self, bucket: str, key: str) -> int:
        # the middleware runs inside a request: ask moto's backend directly, not over HTTP
        from moto.s3.models import s3_backends
        for account in list(s3_backends):
            for region in list(s3_backends[account]):
                try:
                    b = s3_backends[account][region].buckets.get(bucket)
                except Exception:  # noqa: BLE001 - a region without the bucket
                    b = None
                if b is not None and key in b.keys:
                    return int(b.keys[key].size)
        return 0

    # ---- counters ----------------------------------------------------------------------------------
    def reset(self) -> None:
        with self.app.lock:
            self.app.requests.clear()

    def requests(self, prefix: str | None = None) -> list[dict]:
        """Requests so far (optionally only those whose path starts with /<bucket>/<prefix>)."""
        with self.app.lock:
            rows = list(self.app.requests)
        if prefix is not None:
            want = f"/{self.bucket}/{prefix.strip('/')}"
            rows = [r for r in rows if r["path"].startswith(want)]
        return rows

    def counters(self, prefix: str | None = None) -> dict:
        rows = self.requests(prefix)
        # POST ?delete is DeleteObjects (a list of keys), not data
        deletes = [r for r in rows if r["method"] == "DELETE" or (r["method"] == "POST" and _is_delete(r["query"]))]
        writes = [r for r in rows if r["method"] in ("PUT", "POST") and r not in deletes]
        return {"put_bytes": sum(r["body_bytes"] for r in writes), "put_requests": len(writes),
                "copies": sum(r["copy"] for r in writes), "copy_bytes": sum(r["copy_bytes"] for r in writes),
                "deletes": len(deletes)}


def _is_delete(query: str) -> bool:
    return "delete" in urllib.parse.parse_qs(query, keep_blank_values=True)
