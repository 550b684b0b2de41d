"""One file from the Hub: fetched over HTTP into a snapshot folder, continuing a partial
`{file}.incomplete` with a Range request, taken up again when its connection is cut (RETRIES
times), the token never sent to another host; and what hub.py shares with it (HubError,
RepoFile, the endpoint and token, which OSErrors are the cache folder's fault)."""

from __future__ import annotations

import errno
import logging
import os
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("batchgen.hub")
CHUNK = 1 << 20
RETRIES, RETRY_WAIT_S = 3, 2.0
"""A file whose connection is cut is taken up again this many times (after RETRY_WAIT_S, then
twice that, ...), each continuing where the last stopped."""
CACHE_ERRNOS = {errno.ENOSPC: "free space there", errno.EDQUOT: "free space there",
                errno.EROFS: "it is mounted read-only: remount it",
                errno.EACCES: "this user may not write there",
                errno.EPERM: "this user may not write there",
                errno.ENOTDIR: "a file stands where a folder of it should be",
                errno.EEXIST: "a file stands where a folder of it should be"}
"""OSErrors that mean the cache folder cannot take a download, with the fix each asks for."""
NETWORK_ERRORS = (ssl.SSLError, ConnectionError, TimeoutError, urllib.error.URLError)
"""OSErrors of the connection, whose errno says nothing about the cache folder."""


def cache_fault(err: OSError) -> bool:
    """Whether `err` says the cache folder cannot take the download (CACHE_ERRNOS). A network
    error never does, whatever its errno (a TLS failure's is 1, EPERM's)."""
    return err.errno in CACHE_ERRNOS and not isinstance(err, NETWORK_ERRORS)


class HubError(Exception):
    """A download that cannot happen (unknown, gated or unauthorised repo, no space, offline);
    the message is one line naming the fix."""


@dataclass(frozen=True)
class RepoFile:
    path: str
    size: int


def endpoint() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def token() -> str | None:
    """HF_TOKEN, else huggingface_hub's saved token; without the spaces and newline a token
    read from a file keeps (a secret mounted in a container), as huggingface_hub strips them:
    sent as they are, the request would fail as if the network were down."""
    from huggingface_hub import get_token

    found = (os.environ.get("HF_TOKEN") or "").strip() or get_token()
    return found.strip() if found else None


class CutDownload(HubError):
    """The connection ended before the whole file came; its bytes so far are kept. `what`:
    the cut alone (the retries' log lines), the message adds the fix once they are spent."""

    def __init__(self, what: str):
        super().__init__(f"{what}; run again to continue where it stopped")
        self.what = what


def fetch_retrying(repo: str, commit: str, f: RepoFile, snapshot: Path, bar) -> None:
    """`fetch_file`, taken up again where it stopped when its connection is cut (RETRIES
    times): a proxy or a flaky link dropping a long download does not stop the job."""
    for attempt in range(RETRIES + 1):
        try:
            return fetch_file(repo, commit, f, snapshot, bar)
        except CutDownload as err:
            if attempt == RETRIES:
                raise
            wait_s = RETRY_WAIT_S * 2 ** attempt
            log.warning("%s; continuing in %.0f s (retry %d of %d)", err.what, wait_s,
                        attempt + 1, RETRIES)
            time.sleep(wait_s)


def fetch_file(repo: str, commit: str, f: RepoFile, snapshot: Path, bar) -> None:
    """Fetch one file, continuing a partial `.incomplete` with a Range request. CutDownload
    when the connection ends early (the bytes so far stay for the next try)."""
    dest = snapshot / f.path
    if dest.is_file():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".incomplete")
    have = partial.stat().st_size if partial.is_file() else 0
    url = f"{endpoint()}/{repo}/resolve/{commit}/{urllib.parse.quote(f.path)}"
    headers = {"User-Agent": "batchgen", "Accept-Encoding": "identity"}
    if token():
        headers["Authorization"] = f"Bearer {token()}"
    if have:
        headers["Range"] = f"bytes={have}-"
    opener = urllib.request.build_opener(_SameHostAuth())
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=60) as response:
            if have and response.status != 206:  # the server sent the whole file
                bar.update(-have)
                have = 0
            with open(partial, "ab" if have else "wb") as out:
                while chunk := response.read1(CHUNK):
                    out.write(chunk)
                    bar.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
    except urllib.error.HTTPError as err:
        raise HubError(refused_file(err, repo, f.path, url)) from None
    except OSError as err:
        if cache_fault(err):  # our write failed: the cache folder's fault (download)
            raise
        raise CutDownload(f"download of {f.path} of {repo} was cut ({err})") from None
    size = partial.stat().st_size
    if f.size and size < f.size:  # the server closed the connection early: resumable
        raise CutDownload(f"download of {f.path} of {repo} was cut at {size} of {f.size} "
                          "bytes")
    if f.size and size != f.size:
        partial.unlink()
        raise HubError(f"{f.path} of {repo} arrived with {size} bytes, the Hub lists {f.size}: "
                       "run again to download it afresh")
    os.replace(partial, dest)


def refused_file(err: urllib.error.HTTPError, repo: str, path: str, url: str) -> str:
    """One line for a file the Hub refused. A gated repo's info is served to anyone: the Hub
    refuses only its files (401 without a token, 403 when the token's account has not been
    granted access), saying so in X-Error-Code."""
    code = err.headers.get("X-Error-Code", "") if err.headers else ""
    if code == "GatedRepo":
        said = "a token" if err.code == 401 else "access granted to this token's account"
        return (f"{repo} is gated on {endpoint()} and needs {said} ({err.code}): accept its "
                "licence on the repo's page, then set HF_TOKEN to a token of that account")
    if err.code in (401, 403):
        return (f"{endpoint()} refused {path} of {repo} ({err.code}): set HF_TOKEN to a token "
                "allowed to read it")
    if err.code == 404:
        return (f"{path} of {repo} is listed by {endpoint()} but not served (404): the "
                "revision may have been rewritten; run again, or pin --revision to a commit")
    return (f"cannot download {path} of {repo}: HTTP {err.code} from {url}; run again to "
            "continue the download")


class _SameHostAuth(urllib.request.HTTPRedirectHandler):
    """Follow redirects (the Hub sends large files to a CDN) without sending the token to
    another host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != \
                urllib.parse.urlsplit(req.full_url).netloc:
            new.remove_header("Authorization")
        return new
