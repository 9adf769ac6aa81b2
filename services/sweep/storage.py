"""The sweep's storage adapter: the reads a retirement decision needs, and the removals that follow one.

Every read answers definitely (present / absent, open / none) or `uncertain` (an error, a timeout, 503 SlowDown, an
unparsable answer, a listing cut short); the sweep never deletes on an uncertain answer. It speaks S3 itself over one
aiohttp session (SigV4, empty bodies, a signing key derived once a day): it reads several times per candidate, and
a botocore client costs several times the CPU per call (bench/sweep.py prints both).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Protocol
from urllib.parse import quote, urlsplit

import aiohttp
import yarl

from services.sweep.domain import FileRead, UploadsRead
from services.sweep.settings import SweepSettings

S3_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
Query = Sequence[tuple[str, str | None]]


class StorageError(Exception):
    """A removal that storage did not confirm; the video is not retired this run."""


class _CutShort(Exception):
    """A listing that was truncated and could not be completed."""


class Storage(Protocol):
    async def read_file(self, key: str) -> FileRead: ...

    async def read_uploads(self, keys: Sequence[str]) -> dict[str, UploadsRead]:
        """The open multipart uploads of each key (one listing for many keys where storage allows)."""
        ...

    async def remove_file(self, key: str) -> None: ...

    async def abort_upload(self, key: str, upload_id: str) -> None: ...


# ------------------------------------------------------------------------------------------- listings


@dataclass(frozen=True)
class UploadsPage:
    uploads: tuple[tuple[str, str], ...]  # (key, upload id)
    truncated: bool
    next_key_marker: str | None
    next_upload_id_marker: str | None


def parse_uploads_page(body: bytes) -> UploadsPage:
    """One page of ListMultipartUploads; raises ValueError on anything that is not one."""
    try:
        root = ET.fromstring(body)
    except ET.ParseError as exc:
        raise ValueError(f"not XML: {exc}") from exc
    if root.tag.removeprefix(S3_NS) != "ListMultipartUploadsResult":
        raise ValueError(f"unexpected document {root.tag!r}")

    def text(element: ET.Element, name: str) -> str | None:
        child = element.find(S3_NS + name)
        if child is None:
            child = element.find(name)
        return child.text if child is not None and child.text else None

    uploads = []
    for up in [*root.findall(S3_NS + "Upload"), *root.findall("Upload")]:
        key, upload_id = text(up, "Key"), text(up, "UploadId")
        if key is None or upload_id is None:
            raise ValueError("an upload without its key or id")
        uploads.append((key, upload_id))
    truncated = (text(root, "IsTruncated") or "false").strip().lower() == "true"
    return UploadsPage(tuple(uploads), truncated, text(root, "NextKeyMarker"), text(root, "NextUploadIdMarker"))


def listing_prefix(keys: Iterable[str]) -> str:
    """The longest common prefix of the keys (that of the first and last in order), for one listing of them all."""
    ordered = sorted(keys)
    if not ordered:
        return ""
    first, last = ordered[0], ordered[-1]
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[:n]


def _error_code(body: bytes) -> str:
    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return ""
    code = root.find("Code")
    return code.text or "" if code is not None else ""


# ------------------------------------------------------------------------------------------- signing

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
SIGNED_HEADERS = "host;x-amz-content-sha256;x-amz-date"


def uri_encode(text: str, *, keep_slash: bool = False) -> str:
    """SigV4's encoding: everything but unreserved characters (and `/` in a path)."""
    return quote(text, safe="-_.~/" if keep_slash else "-_.~")


def query_string(query: Query) -> str:
    return "&".join(uri_encode(k) if v is None else f"{uri_encode(k)}={uri_encode(v)}" for k, v in query)


@dataclass
class SigV4:
    """AWS Signature Version 4 for S3 requests without a body (HEAD, GET, DELETE)."""

    access_key: str
    secret_key: str
    region: str
    _keys: dict[str, bytes] = field(default_factory=dict, repr=False)

    def _signing_key(self, day: str) -> bytes:
        key = self._keys.get(day)
        if key is None:
            key = ("AWS4" + self.secret_key).encode()
            for part in (day, self.region, "s3", "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            self._keys = {day: key}
        return key

    def headers(self, method: str, host: str, path: str, query: Query, when: datetime) -> dict[str, str]:
        """The headers that sign a request: `path` as sent (already encoded), `query` raw (encoded here)."""
        stamp = when.astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
        day = stamp[:8]
        canonical_query = "&".join(sorted(f"{uri_encode(k)}={uri_encode(v or '')}" for k, v in query))
        canonical = "\n".join((method, path, canonical_query, f"host:{host}", f"x-amz-content-sha256:{EMPTY_SHA256}",
                               f"x-amz-date:{stamp}", "", SIGNED_HEADERS, EMPTY_SHA256))
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        signature = hmac.new(self._signing_key(day), to_sign.encode(), hashlib.sha256).hexdigest()
        return {
            "Host": host, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": stamp,
            "Authorization": f"AWS4-HMAC-SHA256 Credential={self.access_key}/{scope}, "
                             f"SignedHeaders={SIGNED_HEADERS}, Signature={signature}",
        }


# ------------------------------------------------------------------------------------------- adapter


@dataclass
class S3Storage:
    endpoint: str
    bucket: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"
    timeout: float = 10.0
    concurrency: int = 32
    max_pages: int = 100
    _session: aiohttp.ClientSession | None = field(default=None, init=False, repr=False)
    _signer: SigV4 | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_settings(cls, settings: SweepSettings, *, endpoint: str | None = None) -> S3Storage:
        return cls(
            endpoint=(endpoint or settings.s3_endpoint).rstrip("/"), bucket=settings.s3_bucket,
            access_key=settings.s3_access_key, secret_key=settings.s3_secret_key.get_secret_value(),
            region=settings.s3_region, timeout=settings.sweep_storage_timeout_seconds,
            concurrency=settings.sweep_storage_concurrency, max_pages=settings.sweep_listing_max_pages,
        )

    async def open(self) -> S3Storage:
        self._signer = SigV4(self.access_key, self.secret_key, self.region)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.concurrency),
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            auto_decompress=False,
        )
        return self

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> S3Storage:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, key: str | None, query: Query = ()) -> tuple[int, dict[str, str], bytes]:
        assert self._session is not None and self._signer is not None, "storage not opened"
        endpoint = urlsplit(self.endpoint)  # read per call: tests move it to simulate an outage
        path = f"{endpoint.path.rstrip('/')}/{uri_encode(self.bucket)}"
        if key is not None:
            path += "/" + uri_encode(key, keep_slash=True)
        url = f"{endpoint.scheme}://{endpoint.netloc}{path}" + (f"?{query_string(query)}" if query else "")
        headers = self._signer.headers(method, endpoint.netloc, path, query, datetime.now(UTC))
        async with asyncio.timeout(self.timeout), self._session.request(
            method, yarl.URL(url, encoded=True), headers=headers
        ) as resp:
            body = await resp.read() if method != "HEAD" else b""
            return resp.status, dict(resp.headers), body

    async def read_file(self, key: str) -> FileRead:
        try:
            status, headers, _ = await self._call("HEAD", key)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return FileRead.uncertain(f"HEAD {key}: {type(exc).__name__} {exc}".strip())
        if status == 404:
            return FileRead.absent()
        if status != 200:
            return FileRead.uncertain(f"HEAD {key}: HTTP {status}")  # 403, 500, 503 SlowDown: storage did not say
        try:
            size = int(headers["Content-Length"])
            modified: datetime | None = parsedate_to_datetime(headers["Last-Modified"])
        except (KeyError, ValueError, TypeError) as exc:
            return FileRead.uncertain(f"HEAD {key}: unreadable answer ({exc})")
        return FileRead.present(size, modified, headers.get("ETag"))

    async def read_uploads(self, keys: Sequence[str]) -> dict[str, UploadsRead]:
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return {}
        if len(wanted) > 1:
            # one listing for the whole batch while it takes fewer calls than a listing per key; SeaweedFS cannot
            # continue a truncated listing (it sends no NextKeyMarker), so there a batch past one page goes key by key
            try:
                found = await self._list(listing_prefix(wanted), max_pages=min(self.max_pages, len(wanted) // 4 or 1))
            except _CutShort:
                pass
            else:
                return {k: found if isinstance(found, UploadsRead) else _uploads_of(found, k) for k in wanted}
        slots = asyncio.Semaphore(self.concurrency)

        async def one(key: str) -> tuple[str, UploadsRead]:
            async with slots:
                try:
                    listed = await self._list(key, max_pages=self.max_pages)
                except _CutShort as exc:
                    return key, UploadsRead.uncertain(str(exc))
            return key, (listed if isinstance(listed, UploadsRead) else _uploads_of(listed, key))

        return dict(await asyncio.gather(*(one(k) for k in wanted)))

    async def _list(self, prefix: str, *, max_pages: int) -> dict[str, list[str]] | UploadsRead:
        """Every open upload under `prefix` by key, or an uncertain answer; `_CutShort` past `max_pages`."""
        found: dict[str, list[str]] = {}
        markers: list[tuple[str, str | None]] = []
        for _ in range(max_pages):
            try:
                status, _, body = await self._call("GET", None, [("uploads", None), ("prefix", prefix), *markers])
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                return UploadsRead.uncertain(f"list uploads {prefix}: {type(exc).__name__} {exc}".strip())
            if status != 200:
                return UploadsRead.uncertain(f"list uploads {prefix}: HTTP {status} {_error_code(body)}".strip())
            try:
                page = parse_uploads_page(body)
            except ValueError as exc:
                return UploadsRead.uncertain(f"list uploads {prefix}: {exc}")
            for key, upload_id in page.uploads:
                found.setdefault(key, []).append(upload_id)
            if not page.truncated:
                return found
            if not page.next_key_marker:
                raise _CutShort(f"list uploads {prefix}: cut short, and storage gave no marker to continue from")
            markers = [("key-marker", page.next_key_marker)]
            if page.next_upload_id_marker:
                markers.append(("upload-id-marker", page.next_upload_id_marker))
        raise _CutShort(f"list uploads {prefix}: more than {max_pages} page(s)")

    async def remove_file(self, key: str) -> None:
        await self._delete(key, [])

    async def abort_upload(self, key: str, upload_id: str) -> None:
        await self._delete(key, [("uploadId", upload_id)])

    async def _delete(self, key: str, query: Query) -> None:
        try:
            status, _, body = await self._call("DELETE", key, query)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise StorageError(f"DELETE {key}: {type(exc).__name__} {exc}".strip()) from exc
        if status in (200, 204) or (status == 404 and _error_code(body) in ("NoSuchKey", "NoSuchUpload")):
            return  # gone already is gone
        raise StorageError(f"DELETE {key}: HTTP {status} {_error_code(body)}".strip())


def _uploads_of(found: dict[str, list[str]], key: str) -> UploadsRead:
    ids = found.get(key)
    return UploadsRead.open(*ids) if ids else UploadsRead.none()
