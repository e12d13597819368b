"""Hostile inputs read over HTTP and S3 (issue 53, round three): what the tool costs reading
them remotely, counted (the requests in nginx's access log) or measured (peak RSS, as every
case is). Loaded by hostile.py (load_case_files) with its helpers in scope: run, case, Failed,
write, safetensors_bytes, torch_save_bytes, torch_save_legacy_bytes.

A case needs nginx (/usr/sbin/nginx, as tests/remote does); without it the case says so and
passes.
"""
import hashlib
import http.server
import os
import pwd
import socket
import socketserver
import struct
import subprocess
import threading
import time
import urllib.parse

_NGINX = "/usr/sbin/nginx"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Nginx:
    """nginx serving www/ of folder d on a free port of 127.0.0.1, one access-log line a request."""

    def __init__(self, d):
        self.d, self.www = d, os.path.join(d, "www")
        os.makedirs(os.path.join(d, "tmp"), exist_ok=True)
        os.makedirs(self.www, exist_ok=True)
        self.port = _free_port()
        with open(os.path.join(d, "nginx.conf"), "w") as f:
            # the workers read the case's folder (a temporary one, the owner's only) as its owner
            user = f"user {pwd.getpwuid(os.geteuid()).pw_name};\n" if os.geteuid() == 0 else ""
            f.write(user + f"""worker_processes 1;
error_log {d}/error.log;
pid {d}/nginx.pid;
events {{ worker_connections 512; }}
http {{
  default_type application/octet-stream;
  log_format bytes '$request_method $uri $http_range $status $body_bytes_sent';
  access_log {d}/access.log bytes;
  client_body_temp_path {d}/tmp/body; proxy_temp_path {d}/tmp/proxy;
  fastcgi_temp_path {d}/tmp/fcgi; uwsgi_temp_path {d}/tmp/uwsgi; scgi_temp_path {d}/tmp/scgi;
  keepalive_requests 100000;
  server {{ listen 127.0.0.1:{self.port}; root {self.www}; location / {{ }} }}
}}
""")
        self.proc = subprocess.Popen([_NGINX, "-p", d, "-c", os.path.join(d, "nginx.conf"), "-g", "daemon off;"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise Failed("nginx did not listen")

    def url(self, name):
        return f"http://127.0.0.1:{self.port}/{name}"

    def requests(self):
        """The requests logged so far (nginx writes each line as its request ends)."""
        p = os.path.join(self.d, "access.log")
        return open(p).read().splitlines() if os.path.exists(p) else []

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


@case
def remote_many_storages(t):
    """torch.save files of 20,000 small storages (the legacy format: an int64 size before each;
    the zip format: a local header before each) and a safetensors file of the same tensors,
    digested over HTTP: the digest is each tensor's SHA-256, and the requests are about the
    file's bytes over 64 KiB, plus a few (before: one request per tensor, 20,014, 20,052 and
    20,006)."""
    if not os.path.exists(_NGINX):
        print("remote_many_storages: no nginx here, not run")
        return
    n = 20000
    tensors, storages, plain, want = {}, {}, [], []
    for i in range(n):
        data = struct.pack("<2f", i, -i)
        tensors[f"layer{i}.w"] = (str(i), 0, (2,), (1,))
        storages[str(i)] = ("FloatStorage", 2, data)
        plain.append((f"layer{i}.w", "F32", [2], data))
        want.append(f"layer{i}.w F32 [2] {hashlib.sha256(data).hexdigest()}")
    want = "\n".join(sorted(want)) + "\n"
    srv = _Nginx(os.path.join(t, "nginx"))
    try:
        for name, data in (("legacy.bin", torch_save_legacy_bytes(tensors, storages)),
                           ("zip.bin", torch_save_bytes(tensors, storages)),
                           ("model.safetensors", safetensors_bytes(plain))):
            write(os.path.join(srv.www, name), data)
            before = len(srv.requests())
            out, _ = run("remote_many_storages", ["digest", srv.url(name)], 0)
            if out != want:
                raise Failed(f"digest of {name} over HTTP differs from the tensors' SHA-256s")
            time.sleep(0.2)  # the last line of the access log
            got = len(srv.requests()) - before
            bound = len(data) // 65536 + 24
            print(f"remote_many_storages: {name} ({len(data)} bytes, {n} storages): {got} requests (bound {bound})")
            if got > bound:
                raise Failed(f"digest of {name} over HTTP: {got} requests for {len(data)} bytes of {n} storages "
                             f"(at most {bound}: the file's bytes / 64 KiB + 24)")
    finally:
        srv.stop()


class _Listing(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


def _s3_pages(page):
    """An S3 endpoint whose every ListObjectsV2 with a delimiter is `page` (truncated, pointing
    to itself), and whose probes (HEAD, listings without a delimiter) find nothing."""

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def answer(self, code, body):
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self):
            self.answer(404, b"")

        def do_GET(self):
            q = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
            if "list-type" not in q:
                return self.answer(404, b"<Error><Code>NoSuchKey</Code></Error>")
            if "delimiter" not in q:
                return self.answer(200, b"<ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>")
            self.answer(200, page)

    return _Listing(("127.0.0.1", 0), H)


@case
def s3_listing_pages(t):
    """An S3 listing whose every page is 15 MiB of keys (under the 16 MiB page cap) and says
    more follow: exit 1 naming ListObjectsV2, with the keys held bounded (before: 10 million
    keys allowed, 438 to 689 MiB held before a limit stopped it)."""
    items, size, i = [], 0, 0
    while size < 15 << 20:
        s = b"<Contents><Key>ck/f%08d.safetensors</Key></Contents>" % i
        items.append(s)
        size += len(s)
        i += 1
    page = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><IsTruncated>true</IsTruncated>'
            b"<NextContinuationToken>next</NextContinuationToken>" + b"".join(items) + b"</ListBucketResult>")
    srv = _s3_pages(page)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    env = {"AWS_ACCESS_KEY_ID": "hostile", "AWS_SECRET_ACCESS_KEY": "hostile", "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{srv.server_address[1]}",
           "AWS_CONFIG_FILE": os.path.join(t, "none"), "AWS_SHARED_CREDENTIALS_FILE": os.path.join(t, "none")}
    saved = {k: os.environ.get(k) for k in list(env) + ["AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_REGION"]}
    try:
        for k in saved:
            os.environ.pop(k, None)
        os.environ.update(env)
        run("s3_listing_pages", ["inspect", "s3://bkt/ck"], 1, ["s3://bkt/ck", "ListObjectsV2", "refusing to list further"])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        srv.shutdown()
        srv.server_close()
