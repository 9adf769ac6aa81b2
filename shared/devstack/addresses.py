"""Where the embedded servers listen, as the stack hands it to `weir up`, the services and the tests."""

from __future__ import annotations

from dataclasses import dataclass, field

# "nats", or with a cluster "nats-1" ... "nats-N"; then "postgres" and "s3"
ServerName = str

HOST = "127.0.0.1"
S3_REGION = "us-east-1"


@dataclass(frozen=True)
class StackAddresses:
    nats_url: str
    database_url: str
    s3_endpoint: str
    s3_bucket: str
    s3_access_key: str
    s3_secret_key: str
    s3_region: str
    # each bus identity's NKEY seed file (shared/identities.py); empty when NATS lets anyone in
    nats_identities: dict[str, str] = field(default_factory=dict)
