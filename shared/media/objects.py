"""Removing every object under a storage prefix (a video's files, one attempt's HLS or artwork): list, then delete in
batches, until the listing is empty."""

from __future__ import annotations

from typing import Any

S3_DELETE_LIMIT = 1000  # DeleteObjects takes at most this many keys


class RemoveFailed(RuntimeError):
    """Storage refused to delete some keys."""


async def remove_prefix(s3: Any, bucket: str, prefix: str, *, batch: int = S3_DELETE_LIMIT) -> int:
    """Delete every object whose key starts with `prefix` (non-empty, ending in `/`); returns how many. Safe to
    repeat: each round lists what is left, so keys written meanwhile go too, and a failure leaves the rest for the
    next call."""
    if not prefix.endswith("/") or prefix == "/":
        raise ValueError(f"refusing to remove under {prefix!r}: a prefix ends in '/'")
    size = max(1, min(batch, S3_DELETE_LIMIT))
    removed = 0
    while True:
        listed = await s3.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=size)
        keys = [o["Key"] for o in listed.get("Contents", [])]
        if not keys:
            return removed
        answer = await s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True})
        errors = answer.get("Errors") or []
        if errors:
            raise RemoveFailed(f"{len(errors)} of {len(keys)} keys under {prefix} not deleted: "
                               f"{errors[0].get('Code')} {errors[0].get('Key')}")
        removed += len(keys)
