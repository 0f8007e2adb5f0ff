"""A loopback HTTP server that speaks as much of the Hugging Face hub's API as `snapshot_download` uses
(huggingface_hub 2.x), for download tests that never reach the internet:

    GET  /api/models/{org}/{name}/revision/{rev}       {"id", "sha", "siblings": [{"rfilename"}]}
    GET  /api/models/{org}/{name}/tree/{rev}            [{"type": "file", "path", "size", "oid"}] (recursive)
    HEAD /{org}/{name}/resolve/{rev}/{path}             ETag, X-Repo-Commit, Content-Length
    GET  /{org}/{name}/resolve/{rev}/{path}             the bytes (Range honoured: resumable)

    with HubDouble({"org/tiny": model_dir}) as hub:      # point HF_ENDPOINT at hub.url
        hub.corrupt("org/tiny", "model.safetensors")       # serve flipped bytes from now on

`gets` counts the file GETs per path, `starts` the byte each began at (a resumed download asks a Range).
A file in `withheld` is answered 404, once another file's bytes have been sent.
The `hub` fixture serves the tiny model as `org/tiny` with HF_ENDPOINT pointed at it (conftest.py shares
it with every test module).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubDouble:
    def __init__(self, repos: dict[str, Path]) -> None:
        self._files: dict[str, dict[str, bytes]] = {
            repo: {p.name: p.read_bytes() for p in sorted(Path(d).iterdir()) if p.is_file()}
            for repo, d in repos.items()}
        self.gets: Counter[str] = Counter()
        self.starts: dict[str, list[int]] = {}  # per file GET: the byte it started from (Range)
        self.withheld: set[str] = set()  # file names answered 404 (a transfer that breaks off)
        self.served = threading.Event()  # a file's bytes were sent: a withheld file's 404 waits for it
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def corrupt(self, repo: str, name: str) -> None:
        data = bytearray(self._files[repo][name])
        data[len(data) // 2] ^= 0xFF
        self._files[repo][name] = bytes(data)

    def __enter__(self) -> HubDouble:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _json(self, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _missing(self) -> None:
                self.send_response(404)
                self.send_header("X-Error-Code", "RepoNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _route(self, head: bool) -> None:
                path = self.path.split("?", 1)[0]
                if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path):
                    files = hub._files.get(m[1])
                    if files is None:
                        return self._missing()
                    return self._json({"id": m[1], "sha": COMMIT, "siblings": [{"rfilename": n} for n in files]})
                if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path):
                    files = hub._files.get(m[1])
                    if files is None:
                        return self._missing()
                    return self._json([{"type": "file", "path": n, "size": len(b), "oid": _oid(b)}
                                       for n, b in files.items()])
                if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
                    data = hub._files.get(m[1], {}).get(m[3])
                    if m[3] in hub.withheld:
                        # Broken off after another file went through, so a download that fails here
                        # has always completed something.
                        hub.served.wait(timeout=30)
                        return self._missing()
                    if data is None:
                        return self._missing()
                    return self._file(data, m[3], head)
                return self._missing()

            def _file(self, data: bytes, name: str, head: bool) -> None:
                start = 0
                if not head and (r := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))):
                    start = min(int(r[1]), len(data))
                self.send_response(206 if start else 200)
                self.send_header("ETag", f'"{_oid(data)}"')
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(data) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if not head:
                    hub.gets[name] += 1
                    hub.starts.setdefault(name, []).append(start)
                    self.wfile.write(data[start:])
                    self.wfile.flush()
                    hub.served.set()

            def do_GET(self) -> None:  # noqa: N802
                self._route(head=False)

            def do_HEAD(self) -> None:  # noqa: N802
                self._route(head=True)

        return Handler


def _oid(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


@pytest.fixture
def hub(tiny_model_path, monkeypatch):
    import huggingface_hub.constants as constants

    with HubDouble({"org/tiny": tiny_model_path}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield hub
