"""SeaweedFS (`weed mini`) as the stack's S3, and a plain S3 client for it."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import botocore.session
from botocore.config import Config as BotoConfig
from botocore.exceptions import ClientError

from shared.devstack.addresses import HOST, S3_REGION, ServerName
from shared.devstack.ports import claim_port
from shared.devstack.processes import binary
from shared.devstack.runfiles import write_atomic
from shared.devstack.server import Server

# the origins SeaweedFS's S3 answers CORS for, on buckets without rules of their own: any, as the bucket's rules
# (shared/storage.py) say, because a presigned URL is the credential
S3_ALLOWED_ORIGINS = ("*",)


class SeaweedS3(Server):
    name: ServerName = "s3"
    # weed mini opens an HTTP and a gRPC port for each of these; all are chosen here so that two stacks can run
    # side by side. gRPC is always HTTP + 10000: the maintenance worker assumes so for the admin server.
    components = ("s3", "master", "volume", "filer", "admin")
    port_names = tuple(n for c in components for n in (c, f"{c}_grpc"))
    grpc_offset = 10000
    stop_timeout_s = 20.0

    def choose_ports(self, previous: dict[str, int]) -> None:
        self.ports = {}
        for component in self.components:
            port = claim_port(previous.get(component), grpc_offset=self.grpc_offset)
            self.ports |= {component: port, f"{component}_grpc": port + self.grpc_offset}

    def url(self) -> str:
        return f"http://{HOST}:{self.ports['s3']}"

    @property
    def identities_path(self) -> Path:
        return self.stack.data_dir / "run" / "s3-identities.json"

    def env(self) -> dict[str, str]:
        # weed mini turns AWS_* variables into credentials; only the static identities file may grant access
        return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}

    def prepare(self) -> None:
        super().prepare()
        identity = {
            "name": "weir",
            "credentials": [{"accessKey": self.stack.s3_access_key, "secretKey": self.stack.s3_secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        write_atomic(self.identities_path, json.dumps({"identities": [identity]}), mode=0o600)
        # weed mini re-applies the options it saved last time; the command line below is the whole truth
        (self.dir / "mini.options").unlink(missing_ok=True)

    def command(self) -> list[str]:
        p = self.ports
        return [
            binary("weed"),
            "-logtostderr",
            "mini",
            f"-dir={self.dir}",
            f"-ip={HOST}",  # without -ip the volume server is advertised on an address it does not listen on
            f"-ip.bind={HOST}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin_grpc']}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={self.identities_path}",
            # set explicitly rather than left to weed's default; a bucket's own CORS rules (`weir storage apply`),
            # when it has any, replace these for that bucket
            f"-s3.allowedOrigins={','.join(self.stack.s3_allowed_origins)}",
            "-master.telemetry=false",
            "-volume.preStopSeconds=0",  # a single volume server has no one to hand over to before it stops
        ]  # fmt: skip

    def after_stop(self) -> None:
        # weed leaves Unix sockets named after its ports in the temp dir
        for tmp in {Path(tempfile.gettempdir()), Path("/tmp")}:
            for port in self.ports.values():
                for sock in tmp.glob(f"seaweedfs-*-{port}.sock"):
                    with contextlib.suppress(OSError):
                        if stat.S_ISSOCK(sock.lstat().st_mode):
                            sock.unlink()

    def wait_ready(self, deadline: float) -> None:
        client = s3_client(self.url(), self.stack.s3_access_key, self.stack.s3_secret_key)
        bucket = self.stack.s3_bucket
        key = ".devstack/ready"

        def usable() -> bool:
            try:
                client.create_bucket(Bucket=bucket)
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise
            client.put_object(Bucket=bucket, Key=key, Body=b"ready")
            body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
            client.delete_object(Bucket=bucket, Key=key)
            return bool(body == b"ready")

        self.poll_until(deadline, usable, "bucket, put, get, delete")


def s3_client(endpoint: str, access_key: str, secret_key: str, region: str = S3_REGION) -> Any:
    """A plain synchronous S3 client (botocore) for the stack's storage; also handy in tests."""
    session = botocore.session.get_session()
    return session.create_client(
        "s3",
        endpoint_url=endpoint,
        region_name=region,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        config=BotoConfig(
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            retries={"max_attempts": 1},
            connect_timeout=2,
            read_timeout=10,
        ),
    )
