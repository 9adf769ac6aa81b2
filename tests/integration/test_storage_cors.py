"""Storage CORS (issue 14): browsers PUT parts and GET renditions straight from the bucket with presigned URLs, so
the bucket's CORS rules (`weir storage apply`, run by `weir up`) must answer their preflights and expose `ETag`.
On the session's real SeaweedFS, whose bucket `prepared` has already given the rules."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.devstack.seaweed import S3_ALLOWED_ORIGINS, SeaweedS3
from shared.devstack.stack import DevStack
from shared.settings import CommonSettings
from shared.storage import CORS_MAX_AGE_S, CORS_RULES, apply_bucket_cors, bucket_cors, s3_client

ORIGIN = "https://app.example"


def _acl(response: httpx.Response, name: str) -> set[str]:
    """A comma-separated Access-Control-* header as a set of lower-case items."""
    return {v.strip().lower() for v in response.headers.get(name, "").split(",") if v.strip()}


def _allows(response: httpx.Response, origin: str) -> bool:
    return response.headers.get("access-control-allow-origin") in (origin, "*")


@pytest.fixture
async def s3(prepared: CommonSettings) -> AsyncIterator[Any]:
    async with s3_client(prepared) as client:
        yield client


@pytest.fixture
async def upload(prepared: CommonSettings, s3: Any) -> AsyncIterator[tuple[str, str]]:
    """A multipart upload in progress: (key, upload id)."""
    key = f"test-cors/{uuid.uuid4().hex}"
    created = await s3.create_multipart_upload(Bucket=prepared.s3_bucket, Key=key)
    yield key, created["UploadId"]
    await s3.abort_multipart_upload(Bucket=prepared.s3_bucket, Key=key, UploadId=created["UploadId"])


async def _part_url(s3: Any, bucket: str, key: str, upload_id: str, part_number: int = 1) -> str:
    # as services/api/objects.py presigns them
    url: str = await s3.generate_presigned_url(
        "upload_part",
        Params={"Bucket": bucket, "Key": key, "UploadId": upload_id, "PartNumber": part_number},
        ExpiresIn=300,
    )
    return url


def test_seaweedfs_is_started_with_its_allowed_origins_set(tmp_path: Path) -> None:
    server = SeaweedS3(DevStack(tmp_path))
    server.ports = dict.fromkeys(server.port_names, 1)
    assert S3_ALLOWED_ORIGINS == ("*",)
    assert "-s3.allowedOrigins=*" in server.command()
    narrow = SeaweedS3(DevStack(tmp_path, s3_allowed_origins=("https://a.example", "https://b.example")))
    narrow.ports = dict(server.ports)
    assert "-s3.allowedOrigins=https://a.example,https://b.example" in narrow.command()


async def test_preflight_of_a_presigned_part_put_allows_any_origin(
    prepared: CommonSettings, s3: Any, upload: tuple[str, str]
) -> None:
    url = await _part_url(s3, prepared.s3_bucket, *upload)
    async with httpx.AsyncClient(timeout=10) as http:
        for origin in (ORIGIN, "http://localhost:5173"):
            r = await http.options(url, headers={"Origin": origin, "Access-Control-Request-Method": "PUT",
                                                 "Access-Control-Request-Headers": "content-type, content-md5"})
            assert r.status_code in (200, 204), (r.status_code, r.text)
            assert _allows(r, origin), r.headers
            assert "put" in _acl(r, "access-control-allow-methods"), r.headers
            allowed_headers = _acl(r, "access-control-allow-headers")
            assert allowed_headers == {"*"} or {"content-type", "content-md5"} <= allowed_headers, r.headers
            assert r.headers.get("access-control-max-age") == str(CORS_MAX_AGE_S), r.headers
        # the bucket's rules are what is served, not SeaweedFS's global defaults (which allow DELETE too)
        r = await http.options(url, headers={"Origin": ORIGIN, "Access-Control-Request-Method": "DELETE"})
        assert not (r.status_code < 300 and "delete" in _acl(r, "access-control-allow-methods")), r.headers


async def test_a_part_put_from_a_page_gets_its_origin_allowed_and_etag_exposed(
    prepared: CommonSettings, s3: Any, upload: tuple[str, str]
) -> None:
    key, upload_id = upload
    url = await _part_url(s3, prepared.s3_bucket, key, upload_id)
    body = os.urandom(1024)
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.put(url, content=body, headers={"Origin": ORIGIN})
    assert r.status_code == 200, r.text
    assert _allows(r, ORIGIN), r.headers
    assert "etag" in _acl(r, "access-control-expose-headers"), r.headers
    etag = r.headers["etag"]
    listed = await s3.list_parts(Bucket=prepared.s3_bucket, Key=key, UploadId=upload_id)
    assert [(p["PartNumber"], p["ETag"]) for p in listed["Parts"]] == [(1, etag)]


async def test_a_ranged_presigned_get_from_a_page_is_206_with_its_origin_allowed(
    prepared: CommonSettings, s3: Any
) -> None:
    key = f"test-cors/{uuid.uuid4().hex}.mp4"
    content = bytes(range(256)) * 4
    await s3.put_object(Bucket=prepared.s3_bucket, Key=key, Body=content)
    try:
        url = await s3.generate_presigned_url("get_object", Params={"Bucket": prepared.s3_bucket, "Key": key},
                                              ExpiresIn=300)
        async with httpx.AsyncClient(timeout=10) as http:
            pre = await http.options(url, headers={"Origin": ORIGIN, "Access-Control-Request-Method": "GET",
                                                   "Access-Control-Request-Headers": "range"})
            assert pre.status_code in (200, 204) and _allows(pre, ORIGIN), pre.headers
            # SeaweedFS 4.x answers a GET/HEAD preflight with the origin alone (no Allow-Methods/-Headers), though the
            # rule allows them. Browsers send none for these: GET and HEAD are safelisted methods, and a single
            # `Range: bytes=N-M` is a safelisted header (as is every request of a <video> element); on AWS S3 the
            # rule answers in full.
            methods = _acl(pre, "access-control-allow-methods")
            assert not methods or "get" in methods, pre.headers
            r = await http.get(url, headers={"Origin": ORIGIN, "Range": "bytes=0-9"})
            assert r.status_code == 206, r.text
            assert r.content == content[:10]
            assert _allows(r, ORIGIN), r.headers
            assert {"etag", "content-length", "content-range", "accept-ranges"} <= _acl(
                r, "access-control-expose-headers"), r.headers
            head_url = await s3.generate_presigned_url(  # the signature names the method: HEAD has its own URL
                "head_object", Params={"Bucket": prepared.s3_bucket, "Key": key}, ExpiresIn=300)
            head = await http.head(head_url, headers={"Origin": ORIGIN})
            assert head.status_code == 200 and _allows(head, ORIGIN), head.headers
    finally:
        await s3.delete_object(Bucket=prepared.s3_bucket, Key=key)


async def test_apply_is_idempotent_and_notices_a_change(prepared: CommonSettings, s3: Any) -> None:
    assert await apply_bucket_cors(s3, prepared.s3_bucket) is False  # `prepared` (weir up's prepare) set them
    bucket = f"cors-{uuid.uuid4().hex[:12]}"
    await s3.create_bucket(Bucket=bucket)
    try:
        assert await bucket_cors(s3, bucket) == []
        assert await apply_bucket_cors(s3, bucket) is True
        assert await apply_bucket_cors(s3, bucket) is False
        stored = await bucket_cors(s3, bucket)
        assert {tuple(r["AllowedMethods"]) for r in stored} == {tuple(r["AllowedMethods"]) for r in CORS_RULES}
        # someone narrowed the rules by hand: the next apply puts them back
        narrowed = [{"AllowedMethods": ["PUT"], "AllowedOrigins": [ORIGIN], "AllowedHeaders": ["*"]}]
        assert await apply_bucket_cors(s3, bucket, narrowed) is True
        assert await apply_bucket_cors(s3, bucket) is True
        assert await apply_bucket_cors(s3, bucket) is False
    finally:
        await s3.delete_bucket(Bucket=bucket)


def test_weir_storage_apply_from_the_cli(stack_env: dict[str, str], prepared: CommonSettings) -> None:
    result = subprocess.run([sys.executable, "-m", "weir.cli", "storage", "apply"], capture_output=True, text=True,
                            timeout=120, env={**os.environ, **stack_env})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"unchanged CORS rules of bucket {prepared.s3_bucket}"
