"""The api's storage adapter: multipart uploads, presigned URLs, and reading an assembled file's first bytes."""

from __future__ import annotations

import asyncio
import base64
import zlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from services.api.domain import PART_SIZE_MIN


class StorageUnavailable(Exception):
    """Storage did not answer as expected; the route answers 503 and changes nothing."""


class PartsRefused(Exception):
    """Storage refused the client's list of parts (an unknown part or ETag, parts too small): the client's mistake,
    answered 400, not a storage outage to retry."""


# what CompleteMultipartUpload answers about the parts it was given (NoSuchUpload: no part of an upload that is
# still open was stored, as SeaweedFS says it; the caller has just seen the upload listed as open)
_PARTS_ERRORS = {"InvalidPart", "InvalidPartOrder", "EntityTooSmall", "NoSuchUpload", "MalformedXML"}
# said as the client can act on it (storage's own messages speak of its internals, e.g. an upload id "may be invalid")
_PARTS_SAID = {
    "InvalidPart": "a part listed was not uploaded, or its ETag is not the one its upload answered",
    "NoSuchUpload": "a part listed was not uploaded (GET .../upload/parts lists those stored)",
    "InvalidPartOrder": "the parts must be listed in ascending part number",
    "EntityTooSmall": f"every part but the last must be at least {PART_SIZE_MIN // 2**20} MiB",
}


@dataclass
class Objects:
    s3: Any
    bucket: str

    async def open_upload(self, key: str, content_type: str) -> str:
        resp = await self.s3.create_multipart_upload(Bucket=self.bucket, Key=key, ContentType=content_type)
        upload_id: str = resp["UploadId"]
        return upload_id

    async def upload_is_open(self, key: str, upload_id: str) -> bool:
        """Whether storage still lists this upload as open (SeaweedFS would complete a completed one again)."""
        marker: dict[str, str] = {}
        while True:
            resp = await self.s3.list_multipart_uploads(Bucket=self.bucket, Prefix=key, **marker)
            if any(u["Key"] == key and u["UploadId"] == upload_id for u in resp.get("Uploads", [])):
                return True
            if not resp.get("IsTruncated"):
                return False
            if not resp.get("NextKeyMarker") or not resp.get("NextUploadIdMarker"):
                # a cut-short listing with no way on (SeaweedFS sends no markers): storage cannot say; never a guess
                raise StorageUnavailable("the multipart upload listing was cut short")
            marker = {"KeyMarker": resp["NextKeyMarker"], "UploadIdMarker": resp["NextUploadIdMarker"]}

    async def list_parts(self, key: str, upload_id: str) -> list[StoredPart] | None:
        """The parts stored so far of an open upload, by part number; None when storage knows no such upload."""

        async def page(marker: int | None) -> Mapping[str, Any]:
            extra = {"PartNumberMarker": marker} if marker is not None else {}
            resp: Mapping[str, Any] = await self.s3.list_parts(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                               **extra)
            return resp

        try:
            return await collect_parts(page)
        except ClientError as exc:
            if _code(exc) == "NoSuchUpload":
                return None
            raise

    async def upload_part(self, key: str, upload_id: str, part_number: int, data: bytes) -> str:
        """One part stored by the api itself (an import); its ETag. Its CRC32 is computed on a thread (zlib lets go
        of the GIL) and sent, so botocore does not compute it on the event loop (~20 ms per 16 MiB)."""
        crc = await asyncio.to_thread(zlib.crc32, data)
        resp = await self.s3.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=part_number,
                                         Body=data, ChecksumCRC32=base64.b64encode(crc.to_bytes(4, "big")).decode())
        etag: str = resp["ETag"]
        return etag

    async def part_url(self, key: str, upload_id: str, part_number: int, ttl: int) -> str:
        url: str = await self.s3.generate_presigned_url(
            "upload_part",
            Params={"Bucket": self.bucket, "Key": key, "UploadId": upload_id, "PartNumber": part_number},
            ExpiresIn=ttl,
        )
        return url

    async def get_url(self, key: str, ttl: int, *, disposition: str | None = None) -> str:
        """A presigned GET URL; `disposition`: the Content-Disposition storage answers with (a download's)."""
        params = {"Bucket": self.bucket, "Key": key}
        if disposition is not None:
            params["ResponseContentDisposition"] = disposition
        url: str = await self.s3.generate_presigned_url("get_object", Params=params, ExpiresIn=ttl)
        return url

    async def complete(self, key: str, upload_id: str, parts: list[tuple[int, str]]) -> None:
        try:
            await self.s3.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id,
                MultipartUpload={"Parts": [{"PartNumber": n, "ETag": etag} for n, etag in sorted(parts)]},
            )
        except ClientError as exc:
            if _code(exc) in _PARTS_ERRORS:
                raise PartsRefused(_PARTS_SAID.get(_code(exc), "storage refused these parts")
                                   + f" (storage: {_code(exc)})") from exc
            raise

    async def abort(self, key: str, upload_id: str) -> None:
        try:
            await self.s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except ClientError as exc:
            if _code(exc) != "NoSuchUpload":
                raise

    async def head(self, key: str) -> tuple[int, str] | None:
        """(size, content type) of a stored object, or None when there is none."""
        try:
            resp = await self.s3.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return int(resp["ContentLength"]), str(resp.get("ContentType") or "application/octet-stream")

    async def read_range(self, key: str, start: int, length: int) -> bytes:
        resp = await self.s3.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{start + length - 1}")
        async with resp["Body"] as body:
            data: bytes = await body.read()
        return data

    async def read_small(self, key: str, most: int) -> bytes | None:
        """A small object's bytes (a playlist, a storyboard); None when there is none. Raises StorageUnavailable for
        one larger than `most` (never read whole)."""
        try:
            resp = await self.s3.get_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        async with resp["Body"] as body:
            if int(resp.get("ContentLength") or 0) > most:
                raise StorageUnavailable(f"{key} is larger than {most} bytes")
            data: bytes = await body.read()
        return data

    async def put(self, key: str, data: bytes, content_type: str) -> None:
        await self.s3.put_object(Bucket=self.bucket, Key=key, Body=data, ContentType=content_type)

    async def delete_prefix(self, prefix: str) -> None:
        """Every object under `prefix` (a video's renditions, HLS files, artwork, thumbnails)."""
        token: dict[str, str] = {}
        while True:
            resp = await self.s3.list_objects_v2(Bucket=self.bucket, Prefix=prefix, **token)
            for item in resp.get("Contents") or ():
                await self.s3.delete_object(Bucket=self.bucket, Key=item["Key"])
            if not resp.get("IsTruncated") or not resp.get("NextContinuationToken"):
                return
            token = {"ContinuationToken": resp["NextContinuationToken"]}

    async def delete(self, *keys: str) -> None:
        for key in keys:
            await self.s3.delete_object(Bucket=self.bucket, Key=key)


@dataclass(frozen=True)
class StoredPart:
    part_number: int
    etag: str
    size: int


async def collect_parts(page: Callable[[int | None], Awaitable[Mapping[str, Any]]]) -> list[StoredPart]:
    """Every page of a ListParts listing (`page(marker)` answers one), by part number.

    A page cut short (IsTruncated) names where the next begins (NextPartNumberMarker); one that does not, or names a
    marker that does not move on, leaves storage unable to say what it holds: StorageUnavailable, never a guess."""
    found: dict[int, StoredPart] = {}
    marker: int | None = None
    while True:
        resp = await page(marker)
        for p in resp.get("Parts") or ():
            number = int(p["PartNumber"])
            found[number] = StoredPart(number, str(p["ETag"]), int(p["Size"]))
        if not resp.get("IsTruncated"):
            return [found[n] for n in sorted(found)]
        following = resp.get("NextPartNumberMarker")
        try:
            following_number = int(following) if following not in (None, "") else None
        except (TypeError, ValueError):
            following_number = None
        if following_number is None or following_number <= (marker or 0):
            raise StorageUnavailable("the part listing was cut short with no way on")
        marker = following_number


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
