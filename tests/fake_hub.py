"""A Hugging Face Hub on loopback for download tests: serves model folders through the
endpoints huggingface_hub and batchgen call (no network).

  GET  /api/models/{org}/{name}/revision/{rev}      repo info: sha, siblings with sizes
  HEAD /{org}/{name}/resolve/{rev}/{file}           X-Repo-Commit, ETag, Content-Length, ...
  GET  /{org}/{name}/resolve/{rev}/{file}           the bytes; Range: bytes=N- gives 206

Repos can be private (401 without the right token) or gated: as on the real Hub, a gated
repo's info is served to anyone and its files are refused (401 without a token, 403 with a
token not granted access; X-Error-Code: GatedRepo). Unknown repos are 404 (X-Error-Code:
RepoNotFound). A repo may hold several revisions (`revisions`: name -> folder), each its own
commit; an unknown revision is 404 (X-Error-Code: RevisionNotFound). `stall_after` makes GETs
of one file stop after that many bytes until `release()`, so a test can kill a download
mid-file; `cut_after` makes the next GET of one file end after that many bytes (the server
closes the connection, as a proxy dropping a long download does).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class Repo:
    folder: Path
    sha: str
    private_token: str | None = None
    gated: bool = False
    granted_token: str | None = None
    """The token allowed to read a gated repo's files."""
    revisions: dict[str, Path] = field(default_factory=dict)
    """Branch or tag -> the folder that revision holds ("main" and the sha: `folder`)."""

    def commit(self, revision: str) -> tuple[str, Path] | None:
        """(sha, folder) of a branch, tag or commit; None when the repo has no such one."""
        if revision in ("main", self.sha):
            return self.sha, self.folder
        for name, folder in self.revisions.items():
            sha = hashlib.sha1(f"{self.sha}@{name}".encode()).hexdigest()
            if revision in (name, sha):
                return sha, folder
        return None


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    """(method, path, Range header) of every request received."""
    stall_after: dict[str, int] = field(default_factory=dict)
    """file name -> bytes sent before GETs of it stall (until release())."""
    sent: dict[str, int] = field(default_factory=dict)
    """file name -> bytes sent by the last GET of it."""
    cut_after: dict[str, int] = field(default_factory=dict)
    """file name -> bytes the next GET of it sends before the connection is closed (once)."""

    def __post_init__(self):
        self._release = threading.Event()
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, repo_id: str, folder: Path, **kw) -> Repo:
        sha = hashlib.sha1(repo_id.encode()).hexdigest()
        self.repos[repo_id] = Repo(folder, sha, **kw)
        return self.repos[repo_id]

    def release(self) -> None:
        self.stall_after.clear()
        self._release.set()

    def close(self) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()

    def log(self, method: str, path: str, range_: str | None) -> None:
        with self._lock:
            self.requests.append((method, path, range_))


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def do_HEAD(self):
            self._serve(body=False)

        def do_GET(self):
            self._serve(body=True)

        def _error(self, status: int, code: str | None, message: str) -> None:
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _repo(self, repo_id: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
                return None
            auth = self.headers.get("Authorization", "")
            if repo.private_token and auth != f"Bearer {repo.private_token}":
                self._error(401, None, "Invalid username or password.")
                return None
            return repo

        def _commit(self, repo: Repo, revision: str) -> tuple[str, Path] | None:
            found = repo.commit(revision)
            if found is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return found

        def _serve(self, body: bool) -> None:
            path = self.path.split("?")[0]
            hub.log(self.command, path, self.headers.get("Range"))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "revision":
                repo = self._repo("/".join(parts[2:4]))
                found = repo and self._commit(repo, parts[5])
                if found:
                    self._info(repo, parts[2:4], *found)
            elif len(parts) >= 5 and parts[2] == "resolve":
                repo = self._repo("/".join(parts[:2]))
                found = repo and self._commit(repo, parts[3])
                if found and self._granted(repo):
                    self._file(*found, "/".join(parts[4:]), body)
            else:
                self._error(404, None, "Not found")

        def _granted(self, repo: Repo) -> bool:
            """A gated repo's files need the granted token (the real Hub's answers)."""
            if not repo.gated:
                return True
            auth = self.headers.get("Authorization", "")
            if repo.granted_token and auth == f"Bearer {repo.granted_token}":
                return True
            if auth:
                self._error(403, "GatedRepo", "Access to model is restricted and you are not "
                            "in the authorized list. Visit the repo's page to ask for access.")
            else:
                self._error(401, "GatedRepo", "Access to model is restricted. You must have "
                            "access to it and be authenticated to access it. Please log in.")
            return False

        def _info(self, repo: Repo, name: list[str], sha: str, folder: Path) -> None:
            files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
            siblings = [{"rfilename": f, "size": (folder / f).stat().st_size,
                         "blobId": hashlib.sha1(f.encode()).hexdigest()} for f in files]
            data = json.dumps({"id": "/".join(name), "modelId": "/".join(name), "sha": sha,
                               "private": bool(repo.private_token),
                               "gated": "auto" if repo.gated else False,
                               "siblings": siblings}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _file(self, sha: str, folder: Path, name: str, body: bool) -> None:
            file = folder / name
            if not file.is_file():
                self._error(404, "EntryNotFound", "Entry not found")
                return
            data = file.read_bytes()
            start = 0
            range_ = self.headers.get("Range")
            if range_ and range_.startswith("bytes=") and body:
                start = int(range_[6:].split("-")[0])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", sha)
            self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            stall = hub.stall_after.get(name)
            chunk = data[start:] if stall is None else data[start:max(start, stall)]
            cut = hub.cut_after.pop(name, None)
            if cut is not None:
                chunk, self.close_connection = data[start:max(start, cut)], True
            self.wfile.write(chunk)
            self.wfile.flush()
            hub.sent[name] = len(chunk)
            if stall is not None:
                hub._release.wait()  # the client is killed meanwhile
                self.close_connection = True
                return
    return Handler
