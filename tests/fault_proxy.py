#!/usr/bin/env python3
"""A faulty HTTP/1.1 proxy for the remote-storage tests (tests/remote/test_http.cpp, tests/remote/test_s3.cpp).

    fault_proxy.py --port P --upstream HOST:PORT --seed N --rate R --log FILE
                   [--faults drop,stall,...] [--stall S] [--kill-parts-after K]
                   [--lose-complete drop|stall] [--head-etag ETAG]

Listens on 127.0.0.1:P and passes each request of a client connection to the upstream server
(nginx, moto_server) on a connection of its own. Requests are numbered in the order they
arrive; request k draws from random.Random(seed) whether it gets a fault (probability R) and
which one of those in --faults that fit it:

  any request, answered by the proxy without passing it on:
    reset      the connection closed at once (RST), no answer
    stall      nothing for --stall seconds (past the client's read timeout), then closed
    s503       503 with Retry-After in seconds (0 or 1)
    s503_date  503 with Retry-After as an HTTP-date one second ahead
    s429       429 with Retry-After: 0
  a GET whose answer has a body:
    drop       the header and half the body, then RST
    truncate   the header and a part of the body (possibly none), then a clean close
  a GET with a Range header that the server answered with 206:
    wrong_range   Content-Range moved by one byte (the body unchanged)
    ignore_range  the request passed on without its Range: 200 with the whole object
    wrong_length  Content-Length off by a few bytes (the body unchanged), then closed

Writes (PUT, POST, DELETE) only get the faults of the first group, so that a fault never
leaves an operation half done upstream. With --kill-parts-after K, every S3 UploadPart after
the first K that arrive (and every retry of them) is reset before it is passed on.

With --lose-complete, the first S3 CompleteMultipartUpload (a POST with uploadId=) is passed
on and the upstream completes it, but its answer is lost: "drop" resets the client connection,
"stall" sends nothing for --stall seconds and closes it (logged as "lose-drop" or "lose-stall").
Every later request to the same target (the client's retry) is answered here with S3's 404
NoSuchUpload, as S3 answers once the upload is complete and gone, and as moto answers a retry
that arrives while the first Complete is still being assembled (logged as "nosuchupload"; a
current moto answers a retry after completion with success, which would hide the case).
With --head-etag, every answer to a HEAD carries that ETag instead of the upstream's (logged as
"head-etag"): an object that looks like another version.

Each fault is one line of --log: "FAULT METHOD TARGET RANGE", written when injected.
"""
import argparse
import asyncio
import email.utils
import random
import socket
import struct
import sys
import time

GENERIC = ["reset", "stall", "s503", "s503_date", "s429"]
BODY = ["drop", "truncate"]
RANGE = ["wrong_range", "ignore_range", "wrong_length"]


class Proxy:
    def __init__(self, a):
        self.up_host, up_port = a.upstream.rsplit(":", 1)
        self.up_port = int(up_port)
        self.rng = random.Random(a.seed)
        self.rate = a.rate
        self.faults = set(a.faults.split(",")) if a.faults else set()
        unknown = self.faults - set(GENERIC + BODY + RANGE)
        if unknown:
            sys.exit("unknown faults: " + ",".join(sorted(unknown)))
        self.stall = a.stall
        self.kill_parts_after = a.kill_parts_after
        self.parts_seen = 0
        self.lose_complete = a.lose_complete
        self.lost_target = None
        self.head_etag = a.head_etag
        self.log = open(a.log, "a", buffering=1)

    def note(self, fault, method, target, rng):
        self.log.write(f"{fault} {method} {target} {rng or '-'}\n")

    def draw(self, method, has_range):
        """The fault of the next request (None for none): one rate draw and one choice."""
        u = self.rng.random()
        pick = self.rng.random()
        if u >= self.rate:
            return None
        fit = [f for f in GENERIC if f in self.faults]
        if method == "GET":
            fit += [f for f in BODY if f in self.faults]
            if has_range:
                fit += [f for f in RANGE if f in self.faults]
        if not fit:
            return None
        return fit[int(pick * len(fit)) % len(fit)]

    async def handle(self, reader, writer):
        up = None
        try:
            while True:
                req = await read_message(reader, is_request=True, writer=writer)
                if req is None:
                    return
                start, headers, body = req
                method, target, _ = start.split(" ", 2)
                rng = header(headers, "Range")
                if self.kill_parts_after is not None and method == "PUT" and "partNumber=" in target:
                    self.parts_seen += 1
                    if self.parts_seen > self.kill_parts_after:
                        self.note("kill", method, target, rng)
                        abort(writer)
                        return
                lose = None
                if self.lost_target is not None and method == "POST" and target == self.lost_target:
                    self.note("nosuchupload", method, target, rng)
                    xml = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NoSuchUpload</Code><Message>The specified '
                           b'upload does not exist. The upload ID may be invalid, or the upload may have been aborted or '
                           b'completed.</Message></Error>')
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Type: application/xml\r\nContent-Length: "
                                 + str(len(xml)).encode() + b"\r\n\r\n" + xml)
                    await writer.drain()
                    continue
                if self.lose_complete and method == "POST" and "uploadId=" in target:
                    lose, self.lose_complete = self.lose_complete, None
                    self.lost_target = target
                    self.note("lose-" + lose, method, target, rng)
                fault = None if lose else self.draw(method, rng is not None)
                if fault:
                    self.note(fault, method, target, rng)
                if fault == "reset":
                    abort(writer)
                    return
                if fault == "stall":
                    await asyncio.sleep(self.stall)
                    writer.close()
                    return
                if fault in ("s503", "s503_date", "s429"):
                    if fault == "s503":
                        ra = str(self.rng.choice([0, 1]))
                    elif fault == "s503_date":
                        ra = email.utils.formatdate(time.time() + 1, usegmt=True)
                    else:
                        ra = "0"
                    code = "429 Too Many Requests" if fault == "s429" else "503 Service Unavailable"
                    writer.write(f"HTTP/1.1 {code}\r\nRetry-After: {ra}\r\nContent-Length: 4\r\n\r\nbusy".encode())
                    await writer.drain()
                    continue
                if fault == "ignore_range":
                    headers = [(k, v) for k, v in headers if k.lower() != "range"]
                # pass the request on (a new upstream connection when the last one closed)
                if up is None:
                    up = await asyncio.open_connection(self.up_host, self.up_port, limit=1 << 20)
                up_r, up_w = up
                up_w.write(encode(start, headers, body))
                await up_w.drain()
                resp = await read_message(up_r, is_request=False, method=method)
                if resp is None:
                    abort(writer)
                    return
                status_line, rh, rbody = resp
                if (header(rh, "Connection") or "").lower() == "close":
                    up_w.close()
                    up = None
                status = int(status_line.split(" ", 2)[1])
                if lose == "drop":
                    abort(writer)
                    return
                if lose == "stall":
                    await asyncio.sleep(self.stall)
                    writer.close()
                    return
                if self.head_etag is not None and method == "HEAD":
                    self.note("head-etag", method, target, rng)
                    rh = set_header(rh, "ETag", self.head_etag)
                close_after = False
                if fault in ("drop", "truncate") and rbody:
                    cut = len(rbody) // 2 if fault == "drop" else self.rng.randrange(len(rbody))
                    writer.write(encode(status_line, rh, rbody[:cut]))
                    await writer.drain()
                    if fault == "drop":
                        abort(writer)
                    else:
                        writer.close()
                    return
                if fault == "wrong_range" and status == 206:
                    first, last, total = content_range(header(rh, "Content-Range"))
                    if last + 1 < total:
                        first, last = first + 1, last + 1
                    else:
                        first, last = first - 1, last - 1
                    rh = set_header(rh, "Content-Range", f"bytes {first}-{last}/{total}")
                if fault == "wrong_length" and rbody:
                    n = len(rbody) + self.rng.choice([-3, -1, 1, 7])
                    rh = set_header(rh, "Content-Length", str(max(n, 0)))
                    close_after = True
                writer.write(encode(status_line, rh, rbody))
                await writer.drain()
                if close_after:
                    writer.close()
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            abort(writer)
        finally:
            if up is not None:
                up[1].close()


def header(headers, name):
    for k, v in headers:
        if k.lower() == name.lower():
            return v
    return None


def set_header(headers, name, value):
    return [(k, value if k.lower() == name.lower() else v) for k, v in headers]


def content_range(v):
    unit, rest = v.split(" ", 1)
    rng, total = rest.split("/")
    first, last = rng.split("-")
    return int(first), int(last), int(total)


def encode(start, headers, body):
    head = start + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    return head.encode("latin-1") + body


def abort(writer):
    """Closes with an RST (SO_LINGER 0), as a dropped connection looks to the other end."""
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()


async def read_message(reader, is_request, method="GET", writer=None):
    """One request or response: (start line, [(name, value)], body), or None at a clean EOF.
    A request's Expect: 100-continue is answered here and not passed on; a response's 1xx
    interim answers are skipped."""
    while True:
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                return None
            raise
        lines = raw[:-4].decode("latin-1").split("\r\n")
        start, headers = lines[0], []
        for line in lines[1:]:
            k, v = line.split(":", 1)
            headers.append((k.strip(), v.strip()))
        if is_request or int(start.split(" ", 2)[1]) >= 200:
            break
    if is_request and (header(headers, "Expect") or "").lower() == "100-continue":
        headers = [(k, v) for k, v in headers if k.lower() != "expect"]
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
    if not is_request:
        status = int(start.split(" ", 2)[1])
        if method == "HEAD" or status in (204, 304):
            return start, headers, b""
    cl = header(headers, "Content-Length")
    if cl is not None:
        return start, headers, await reader.readexactly(int(cl))
    if (header(headers, "Transfer-Encoding") or "").lower() == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass
                break
            body += await reader.readexactly(size)
            await reader.readexactly(2)
        headers = [(k, v) for k, v in headers if k.lower() != "transfer-encoding"]
        headers.append(("Content-Length", str(len(body))))
        return start, headers, body
    if is_request:
        return start, headers, b""
    body = await reader.read()  # until the server closes
    headers.append(("Content-Length", str(len(body))))
    return start, headers, body


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rate", type=float, default=0.0)
    p.add_argument("--faults", default=",".join(GENERIC + BODY + RANGE))
    p.add_argument("--stall", type=float, default=2.0)
    p.add_argument("--kill-parts-after", type=int, default=None)
    p.add_argument("--lose-complete", choices=["drop", "stall"], default=None)
    p.add_argument("--head-etag", default=None)
    p.add_argument("--log", required=True)
    a = p.parse_args()
    proxy = Proxy(a)
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", a.port, limit=1 << 20)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
