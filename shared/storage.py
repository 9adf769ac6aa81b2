"""The S3 client (aioboto3): one client per service process, opened in its lifespan."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aioboto3
from botocore.config import Config

from shared.settings import CommonSettings


@contextlib.asynccontextmanager
async def s3_client(settings: CommonSettings, *, timeout: float = 10.0, unsigned_payload: bool = False
                    ) -> AsyncIterator[Any]:
    """A client of the bucket's storage. `unsigned_payload`: bodies are not hashed into the signature (SigV4's
    UNSIGNED-PAYLOAD), which botocore does on its own over https when a checksum header is sent, but over http (a
    storage on the same machine or network) always, a SHA-256 pass over every body on the caller's event loop (the
    api's imports: bench.imports); their integrity is the CRC32 header sent with each part (Objects.upload_part)."""
    session = aioboto3.Session()
    config = Config(
        signature_version="s3v4",
        s3={"addressing_style": "path", **({"payload_signing_enabled": False} if unsigned_payload else {})},
        connect_timeout=timeout,
        read_timeout=timeout,
        retries={"max_attempts": 2, "mode": "standard"},
    )
    async with session.client(  # type: ignore[call-overload]
        "s3",
        endpoint_url=settings.s3_endpoint,
        aws_access_key_id=settings.s3_access_key,
        aws_secret_access_key=settings.s3_secret_key.get_secret_value(),
        region_name=settings.s3_region,
        config=config,
    ) as client:
        yield client


async def ensure_bucket(client: Any, bucket: str) -> bool:
    """Create the bucket if missing; returns True when it was created."""
    try:
        await client.head_bucket(Bucket=bucket)
        return False
    except client.exceptions.ClientError:
        await client.create_bucket(Bucket=bucket)
        return True


# Browsers upload parts and play renditions straight from storage, with presigned URLs. The signature in the URL is
# the credential (it names the bucket, key, method and expiry), so the bucket allows any origin: an origin check would
# add nothing a leaked URL does not already give, and would break every app whose origins storage cannot know.
CORS_MAX_AGE_S = 3600
CORS_RULES: list[dict[str, Any]] = [
    {
        "ID": "weir-upload-parts",
        "AllowedMethods": ["PUT"],
        "AllowedOrigins": ["*"],
        "AllowedHeaders": ["*"],  # content-type, content-md5, x-amz-* ...
        "ExposeHeaders": ["ETag"],  # the client needs each part's ETag to complete the upload
        "MaxAgeSeconds": CORS_MAX_AGE_S,
    },
    {
        "ID": "weir-read-renditions",
        "AllowedMethods": ["GET", "HEAD"],
        "AllowedOrigins": ["*"],
        "AllowedHeaders": ["*"],  # Range above all
        "ExposeHeaders": ["ETag", "Content-Length", "Content-Range", "Accept-Ranges"],
        "MaxAgeSeconds": CORS_MAX_AGE_S,
    },
]


def _normalized(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rules as a comparable value: stores may reorder lists, change header case or drop empty fields."""
    out = []
    for rule in rules:
        out.append({
            "ID": rule.get("ID", ""),
            "AllowedMethods": sorted(m.upper() for m in rule.get("AllowedMethods", [])),
            "AllowedOrigins": sorted(rule.get("AllowedOrigins", [])),
            "AllowedHeaders": sorted(h.lower() for h in rule.get("AllowedHeaders", [])),
            "ExposeHeaders": sorted(h.lower() for h in rule.get("ExposeHeaders", [])),
            "MaxAgeSeconds": rule.get("MaxAgeSeconds"),
        })
    return sorted(out, key=lambda r: (r["ID"], r["AllowedMethods"]))


async def bucket_cors(client: Any, bucket: str) -> list[dict[str, Any]]:
    """The bucket's CORS rules ([] when it has none)."""
    try:
        response = await client.get_bucket_cors(Bucket=bucket)
    except client.exceptions.ClientError as e:
        if e.response.get("Error", {}).get("Code") == "NoSuchCORSConfiguration":
            return []
        raise
    rules: list[dict[str, Any]] = response.get("CORSRules", [])
    return rules


async def apply_bucket_cors(client: Any, bucket: str, rules: list[dict[str, Any]] | None = None) -> bool:
    """Set the bucket's CORS rules (PutBucketCors), on any S3; returns True when they changed.

    Rule 1: `PUT` (part uploads) from any origin, any request header, `ETag` exposed. Rule 2: `GET` and `HEAD` with
    `Range` (renditions) from any origin, `ETag`, `Content-Length`, `Content-Range` and `Accept-Ranges` exposed.
    Any origin is right here: every request is made with a presigned URL, and the URL's signature is the credential,
    not the page's origin; the api's own routes are where origins are checked. Idempotent: the current rules are read
    first (GetBucketCors) and left alone when they already match.
    """
    wanted = CORS_RULES if rules is None else rules
    if _normalized(await bucket_cors(client, bucket)) == _normalized(wanted):
        return False
    await client.put_bucket_cors(Bucket=bucket, CORSConfiguration={"CORSRules": wanted})
    return True
