"""The S3 client (aioboto3): one client per service process, opened in its lifespan."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aioboto3
from botocore.config import Config

from shared.settings import CommonSettings


@contextlib.asynccontextmanager
async def s3_client(settings: CommonSettings, *, timeout: float = 10.0) -> AsyncIterator[Any]:
    session = aioboto3.Session()
    config = Config(
        signature_version="s3v4",
        s3={"addressing_style": "path"},
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
