"""A Hugging Face Hub endpoint on 127.0.0.1 serving local folders as model repositories, for the pull tests: the
real Hub is out of reach from the test machines, so `huggingface_hub` (the real client, unchanged) is pointed at
this one through HF_ENDPOINT. It answers the two things a download asks: a model's file listing
(/api/models/<repo>[/revision/<rev>]) and each file (/<repo>/resolve/<rev>/<path>, HEAD and GET, with the commit,
ETag and size headers the client checks)."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class LocalHub:
    def __init__(self, repos: dict[str, Path]) -> None:
        self.repos = repos  # "owner/name" -> the folder it serves
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}

    def _answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(handler.path).path)
        self.requests.append(f"{handler.command} {path}")
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"]:
            repo = "/".join(parts[2:4])
            if repo not in self.repos:
                return self._send(handler, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
            siblings = [{"rfilename": name, "size": p.stat().st_size,
                         "lfs": {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "size": p.stat().st_size,
                                 "pointerSize": 134}}
                        for name, p in self._files(repo).items()]
            data = json.dumps({"id": repo, "modelId": repo, "sha": COMMIT, "siblings": siblings}).encode()
            return self._send(handler, 200, data if body else b"", {"Content-Type": "application/json"},
                              length=len(data))
        repo, rest = "/".join(parts[:2]), parts[2:]
        if repo in self.repos and rest[:1] == ["resolve"] and len(rest) >= 3:
            file = self._files(repo).get("/".join(rest[2:]))
            if file is not None:
                data = file.read_bytes()
                digest = hashlib.sha256(data).hexdigest()
                headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{digest}"', "X-Linked-Etag": f'"{digest}"',
                           "X-Linked-Size": str(len(data)), "Content-Type": "application/octet-stream"}
                return self._send(handler, 200, data if body else b"", headers, length=len(data))
        self._send(handler, 404, b"", {"X-Error-Code": "EntryNotFound"})

    @staticmethod
    def _send(handler, status: int, data: bytes, headers: dict[str, str], length: int | None = None) -> None:
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(data) if length is None else length))
        handler.end_headers()
        if data:
            handler.wfile.write(data)
