"""Reading a stored source for encoding: where its content starts (past ID3 tags), its container, its height.

ffmpeg reads the source itself through a presigned GET URL (ranged reads), wrapped in the subfile protocol when ID3
bytes precede the content (`probe.ffmpeg_input`): nothing is downloaded first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.media.content import SniffResult, sniff_object
from shared.media.probe import VideoInfo, probe


@dataclass(frozen=True, slots=True)
class StoredSource:
    url: str  # presigned GET: a credential for its lifetime, never logged
    size: int
    sniffed: SniffResult


async def open_source(s3: Any, bucket: str, key: str, *, url_ttl: int = 3600) -> StoredSource:
    """The source's presigned URL and what its first bytes say; S3 errors propagate (the caller retries)."""
    head = await s3.head_object(Bucket=bucket, Key=key)
    size = int(head["ContentLength"])

    async def read(offset: int, length: int) -> bytes:
        resp = await s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}")
        async with resp["Body"] as body:
            data: bytes = await body.read()
        return data

    sniffed = await sniff_object(read, size=size)
    url: str = await s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=url_ttl)
    return StoredSource(url=url, size=size, sniffed=sniffed)


async def probe_source(source: StoredSource) -> VideoInfo | None:
    """The first video stream of an opened source, or None when it is not a video ffmpeg reads."""
    if source.sniffed.container is None:
        return None
    return await probe(source.url, skip=source.sniffed.id3_bytes_skipped, container=source.sniffed.container)
