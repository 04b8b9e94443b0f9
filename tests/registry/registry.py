"""A container registry for tests/tests/image_push.rs: the OCI distribution API's push and pull
(`/v2/`, blob uploads, monolithic or chunked, cross-repository mounts answered as uploads, manifests by
tag or digest), kept in memory, every blob and manifest checked against its digest.

Listens on 127.0.0.1 (the Docker Engine talks plain HTTP to registries on loopback), prints one JSON
line (`{"registry": "127.0.0.1:PORT"}`), serves until its standard input closes. `GET /_fake/tags`
lists `repository:tag` of every manifest pushed.
"""

import hashlib
import http.server
import json
import sys
import threading
import urllib.parse
import uuid

blobs: dict[str, bytes] = {}
uploads: dict[str, bytearray] = {}
# (repository, reference) -> (media type, bytes)
manifests: dict[tuple[str, str], tuple[str, bytes]] = {}
lock = threading.Lock()


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Registry(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def reply(self, code: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Docker-Distribution-API-Version", "registry/2.0")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def error(self, code: int, what: str, message: str) -> None:
        body = json.dumps({"errors": [{"code": what, "message": message}]}).encode()
        self.reply(code, body, {"Content-Type": "application/json"})

    def read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def route(self) -> None:
        url = urllib.parse.urlparse(self.path)
        query = urllib.parse.parse_qs(url.query)
        path = url.path
        if path == "/_fake/tags":
            with lock:
                tags = sorted(f"{r}:{t}" for (r, t) in manifests if not t.startswith("sha256:"))
            return self.reply(200, json.dumps(tags).encode(), {"Content-Type": "application/json"})
        if path in ("/v2", "/v2/"):
            return self.reply(200, b"{}", {"Content-Type": "application/json"})
        if not path.startswith("/v2/"):
            return self.error(404, "NOT_FOUND", path)
        rest = path[len("/v2/"):]
        if "/blobs/uploads" in rest:
            repo, _, tail = rest.partition("/blobs/uploads")
            upload = tail.strip("/")
            return self.upload(repo, upload, query)
        if "/blobs/" in rest:
            repo, _, d = rest.partition("/blobs/")
            with lock:
                data = blobs.get(d)
            if data is None:
                return self.error(404, "BLOB_UNKNOWN", d)
            return self.reply(200, data, {"Docker-Content-Digest": d,
                                          "Content-Type": "application/octet-stream"})
        if "/manifests/" in rest:
            repo, _, ref = rest.partition("/manifests/")
            if self.command == "PUT":
                body = self.read_body()
                d = digest(body)
                if ref.startswith("sha256:") and ref != d:
                    return self.error(400, "DIGEST_INVALID", f"{ref} is not the manifest's {d}")
                media = self.headers.get("Content-Type", "")
                with lock:
                    manifests[(repo, ref)] = (media, body)
                    manifests[(repo, d)] = (media, body)
                return self.reply(201, b"", {"Docker-Content-Digest": d,
                                             "Location": f"/v2/{repo}/manifests/{d}"})
            with lock:
                found = manifests.get((repo, ref))
            if found is None:
                return self.error(404, "MANIFEST_UNKNOWN", f"{repo}:{ref}")
            media, body = found
            return self.reply(200, body, {"Content-Type": media, "Docker-Content-Digest": digest(body)})
        return self.error(404, "NOT_FOUND", path)

    def upload(self, repo: str, upload: str, query: dict) -> None:
        if self.command == "POST":
            self.read_body()
            uid = str(uuid.uuid4())
            with lock:
                uploads[uid] = bytearray()
            return self.reply(202, b"", {"Location": f"/v2/{repo}/blobs/uploads/{uid}",
                                         "Docker-Upload-UUID": uid, "Range": "0-0"})
        with lock:
            buf = uploads.get(upload)
        if buf is None:
            return self.error(404, "BLOB_UPLOAD_UNKNOWN", upload)
        chunk = self.read_body()
        with lock:
            buf += chunk
        if self.command == "PATCH":
            return self.reply(202, b"", {"Location": f"/v2/{repo}/blobs/uploads/{upload}",
                                         "Docker-Upload-UUID": upload, "Range": f"0-{len(buf) - 1}"})
        if self.command == "PUT":
            want = query.get("digest", [""])[0]
            got = digest(bytes(buf))
            if want != got:
                return self.error(400, "DIGEST_INVALID", f"{want} is not the upload's {got}")
            with lock:
                blobs[got] = bytes(buf)
                del uploads[upload]
            return self.reply(201, b"", {"Location": f"/v2/{repo}/blobs/{got}",
                                         "Docker-Content-Digest": got})
        return self.error(405, "UNSUPPORTED", self.command)

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = route


def main() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Registry)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(json.dumps({"registry": f"127.0.0.1:{server.server_address[1]}"}), flush=True)
    try:
        sys.stdin.read()
    finally:
        server.shutdown()


if __name__ == "__main__":
    main()
