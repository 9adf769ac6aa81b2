"""The sweep's storage adapter without a server: ListMultipartUploads pages, the listing prefix, SigV4."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from services.sweep.storage import SigV4, listing_prefix, parse_uploads_page, query_string

NS = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'


def page(body: str, ns: str = NS) -> bytes:
    return f'<?xml version="1.0" encoding="UTF-8"?><ListMultipartUploadsResult {ns}>{body}' \
           "</ListMultipartUploadsResult>".encode()


def upload(key: str, upload_id: str) -> str:
    return f"<Upload><Key>{key}</Key><UploadId>{upload_id}</UploadId><Initiated>2026-01-01T00:00:00Z</Initiated>" \
           "</Upload>"


def test_a_complete_page() -> None:
    parsed = parse_uploads_page(page("<IsTruncated>false</IsTruncated>" + upload("a/1", "u1") + upload("a/1", "u2")))
    assert parsed.uploads == (("a/1", "u1"), ("a/1", "u2")) and not parsed.truncated


def test_an_empty_page() -> None:
    parsed = parse_uploads_page(page("<Bucket>weir</Bucket><IsTruncated>false</IsTruncated>"))
    assert parsed.uploads == () and not parsed.truncated


def test_an_aws_truncated_page_names_where_to_continue() -> None:
    parsed = parse_uploads_page(page("<IsTruncated>true</IsTruncated><NextKeyMarker>a/1</NextKeyMarker>"
                                     "<NextUploadIdMarker>u1</NextUploadIdMarker>" + upload("a/1", "u1")))
    assert parsed.truncated and (parsed.next_key_marker, parsed.next_upload_id_marker) == ("a/1", "u1")


def test_a_seaweedfs_truncated_page_has_no_key_marker() -> None:
    # SeaweedFS 4.x: IsTruncated with only NextUploadIdMarker; its key-marker filters by equality, so the listing
    # cannot be continued the S3 way and the adapter answers uncertain
    parsed = parse_uploads_page(page("<Delimiter></Delimiter><IsTruncated>true</IsTruncated><KeyMarker></KeyMarker>"
                                     "<NextUploadIdMarker>x_2</NextUploadIdMarker>" + upload("a/1", "x_1")))
    assert parsed.truncated and parsed.next_key_marker is None


def test_a_page_without_namespace() -> None:
    parsed = parse_uploads_page(page("<IsTruncated>false</IsTruncated>" + upload("k", "u"), ns=""))
    assert parsed.uploads == (("k", "u"),)


@pytest.mark.parametrize("body", [
    b"",
    b"not xml",
    b'<?xml version="1.0"?><Error><Code>SlowDown</Code></Error>',
    page("<IsTruncated>false</IsTruncated><Upload><Key>k</Key></Upload>"),
])
def test_anything_else_is_refused(body: bytes) -> None:
    with pytest.raises(ValueError):
        parse_uploads_page(body)


@pytest.mark.parametrize(("keys", "prefix"), [
    (["sources/app/v1"], "sources/app/v1"),
    (["sources/app/v1", "sources/app/v2"], "sources/app/v"),
    (["sources/a/x", "sources/b/y", "sources/a/z"], "sources/"),
    (["x", "y"], ""),
    ([], ""),
])
def test_listing_prefix(keys: list[str], prefix: str) -> None:
    assert listing_prefix(keys) == prefix
    assert all(k.startswith(prefix) for k in keys)


# ------------------------------------------------------------------------------------------- signing


@pytest.mark.parametrize(("method", "path", "query"), [
    ("HEAD", "/weir/sources/app-1/video-1", []),
    ("GET", "/weir", [("uploads", None), ("prefix", "sources/a b/ü~x")]),
    ("GET", "/weir", [("uploads", None), ("prefix", "sources/"), ("key-marker", "sources/k"),
                      ("upload-id-marker", "a_b+c=")]),
    ("DELETE", "/weir/sources/app/video", [("uploadId", "x_y/z")]),
])
def test_signatures_match_botocores(method: str, path: str, query: list[tuple[str, str | None]]) -> None:
    """The adapter's own SigV4 against botocore's signer, at the timestamp botocore chose."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    host = "127.0.0.1:8333"
    url = f"http://{host}{path}" + (f"?{query_string(query)}" if query else "")
    request = AWSRequest(method=method, url=url, headers={})
    S3SigV4Auth(Credentials("weir", "weir-secret-key"), "s3", "us-east-1").add_auth(request)
    when = datetime.strptime(request.headers["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
    ours = SigV4("weir", "weir-secret-key", "us-east-1").headers(method, host, path, query, when)
    assert ours["Authorization"] == request.headers["Authorization"]
    assert ours["x-amz-content-sha256"] == request.headers["X-Amz-Content-SHA256"]


def test_signature_of_aws_published_example() -> None:
    """AWS's documented example (GET Bucket lifecycle, header-based SigV4)."""
    signer = SigV4("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "us-east-1")
    headers = signer.headers("GET", "examplebucket.s3.amazonaws.com", "/", [("lifecycle", None)],
                             datetime(2013, 5, 24, tzinfo=UTC))
    assert headers["Authorization"].endswith(
        "Signature=fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543")
