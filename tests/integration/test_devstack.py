"""The embedded servers: they answer, stop cleanly, survive a killed owner, and come back after an outage.

Each test has its own stack in its own temp dir (not the session's), since each stops and kills servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import nats
import pytest
from nats.js.api import StreamConfig

from shared.devstack.addresses import ServerName, StackAddresses
from shared.devstack.ports import free_port, port_is_free
from shared.devstack.processes import pid_alive, proc_state
from shared.devstack.runfiles import read_pid_file
from shared.devstack.seaweed import s3_client
from shared.devstack.stack import DevStack
from tests.waiting import wait_for, wait_for_sync

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 60.0


def processes_using(path: Path) -> list[int]:
    """Live processes that name `path` on their command line or run inside it."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        inside = f"{path}/" in f"{cwd}/" or any(f"{path}/" in f"{arg}/" for arg in cmdline.split("\0"))
        if inside and pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def assert_all_gone(pids: list[int], ports: list[int], data_dir: Path) -> None:
    assert [p for p in pids if Path(f"/proc/{p}").exists() and pid_alive(p)] == []
    assert [p for p in ports if not port_is_free(p)] == []
    assert processes_using(data_dir) == []


async def nats_answers(url: str) -> int:
    """JetStream answers at `url`; returns the number of streams in the account."""
    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0)
    try:
        info = await nc.jetstream().account_info()
        return int(info.streams)
    finally:
        await nc.close()


async def postgres_answers(url: str) -> None:
    conn = await asyncpg.connect(url, timeout=5)
    try:
        assert await conn.fetchval("select 1") == 1
    finally:
        await conn.close()


def s3_of(a: StackAddresses, secret_key: str | None = None) -> Any:
    return s3_client(a.s3_endpoint, a.s3_access_key, secret_key or a.s3_secret_key, a.s3_region)


def refuses(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


def presigned_multipart_upload(s3: Any, bucket: str, key: str, bodies: list[bytes]) -> None:
    """The upload path Weir relies on: each part PUT to a presigned upload_part URL, then the upload completed."""
    upload_id = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    parts = []
    for number, body in enumerate(bodies, start=1):
        url = s3.generate_presigned_url(
            "upload_part",
            Params={"Bucket": bucket, "Key": key, "UploadId": upload_id, "PartNumber": number},
            ExpiresIn=300,
        )
        with urllib.request.urlopen(urllib.request.Request(url, data=body, method="PUT"), timeout=30) as r:
            parts.append({"PartNumber": number, "ETag": r.headers["ETag"]})
    s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts})


@pytest.fixture
def data_dir() -> Iterator[Path]:
    # Not under tmp_path: each new pytest session resets /tmp/pytest-of-<user> to mode 700, which would lock
    # the postgres system user (when we are root) out of a data dir there.
    with tempfile.TemporaryDirectory(prefix="weir-devstack-test-") as tmp:
        yield Path(tmp) / "servers"


async def test_start_answers_then_stop_leaves_nothing(data_dir: Path) -> None:
    stack = DevStack(data_dir, durable=False)
    try:
        a = await asyncio.to_thread(stack.start)
        pids = list(stack.pids.values())
        ports = [p for server in stack.ports.values() for p in server.values()]
        assert set(stack.timings) == {"nats", "postgres", "s3"}
        assert len(pids) == 3 and len(set(ports)) == len(ports)
        for name, pid in stack.pids.items():
            assert read_pid_file(data_dir / "run" / f"{name}.pid") == (pid, stack.ports[name])

        await nats_answers(a.nats_url)
        await postgres_answers(a.database_url)

        s3 = s3_of(a)
        s3.put_object(Bucket=a.s3_bucket, Key="hello.txt", Body=b"hello")
        assert s3.get_object(Bucket=a.s3_bucket, Key="hello.txt")["Body"].read() == b"hello"
        with pytest.raises(Exception, match="SignatureDoesNotMatch"):
            s3_of(a, secret_key="wrong").get_object(Bucket=a.s3_bucket, Key="hello.txt")

        await asyncio.to_thread(presigned_multipart_upload, s3, a.s3_bucket, "big.bin", [b"a" * 5 * 2**20, b"b" * 1000])
        assert s3.head_object(Bucket=a.s3_bucket, Key="big.bin")["ContentLength"] == 5 * 2**20 + 1000
    finally:
        await asyncio.to_thread(stack.stop)
    assert stack.pids == {}
    assert_all_gone(pids, ports, data_dir)
    assert not list((data_dir / "run").glob("*.pid"))
    await asyncio.to_thread(stack.stop)  # idempotent


async def test_killed_owner_is_cleaned_up_and_data_survives(data_dir: Path) -> None:
    stderr = data_dir.parent / "devstack-main.log"
    with stderr.open("wb") as err:
        owner = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "shared.devstack", "--data-dir", str(data_dir),  # durable, as `weir up` runs it
            cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=err,
        )  # fmt: skip
    second: DevStack | None = None
    try:
        assert owner.stdout is not None
        line = await asyncio.wait_for(owner.stdout.readline(), DEADLINE_S)
        assert line, f"no addresses printed; see {stderr}:\n{stderr.read_text()}"
        a = StackAddresses(**json.loads(line))
        old = {name: read_pid_file(data_dir / "run" / f"{name}.pid") for name in ("nats", "postgres", "s3")}
        old_pids = [entry[0] for entry in old.values() if entry is not None]
        assert len(old_pids) == 3

        conn = await asyncpg.connect(a.database_url)
        await conn.execute("create table survivor (x int); insert into survivor values (42)")
        await conn.close()
        s3_of(a).put_object(Bucket=a.s3_bucket, Key="survivor.txt", Body=b"still here")
        nc = await nats.connect(a.nats_url)
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="SURVIVOR", subjects=["survivor.>"]))
        await js.publish("survivor.one", b"42", stream="SURVIVOR")
        await nc.close()

        # the owner dies without a chance to clean up, and the database crashes with it
        owner.kill()
        await owner.wait()
        postmaster = old["postgres"]
        assert postmaster is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(postmaster[0], signal.SIGKILL)

        second = DevStack(data_dir)
        b = await asyncio.to_thread(second.start)
        await wait_for(lambda: not any(pid_alive(p) for p in old_pids), DEADLINE_S, "the old servers to be gone")
        assert b == a  # the same ports again

        conn = await asyncpg.connect(b.database_url)
        assert await conn.fetchval("select x from survivor") == 42
        await conn.close()
        assert s3_of(b).get_object(Bucket=b.s3_bucket, Key="survivor.txt")["Body"].read() == b"still here"
        nc = await nats.connect(b.nats_url)
        info = await nc.jetstream().stream_info("SURVIVOR")
        assert info.state.messages == 1
        await nc.close()

        new_pids = list(second.pids.values())
        ports = [p for server in second.ports.values() for p in server.values()]
        await asyncio.to_thread(second.stop)
        second = None
        assert_all_gone(old_pids + new_pids, ports, data_dir)
    finally:
        if owner.returncode is None:
            owner.kill()
            await owner.wait()
        if second is not None:
            await asyncio.to_thread(second.stop)


async def test_one_server_stops_and_comes_back_on_the_same_address(data_dir: Path) -> None:
    stack = DevStack(data_dir, durable=False)
    try:
        a = await asyncio.to_thread(stack.start)
        nc = await nats.connect(a.nats_url)
        await nc.jetstream().add_stream(StreamConfig(name="KEPT", subjects=["kept.>"]))
        await nc.close()
        checks: dict[ServerName, Callable[[], Awaitable[Any]]] = {
            "nats": lambda: nats_answers(a.nats_url),
            "postgres": lambda: postgres_answers(a.database_url),
            "s3": lambda: asyncio.to_thread(s3_of(a).head_bucket, Bucket=a.s3_bucket),
        }
        main_port = {"nats": "client", "postgres": "postgres", "s3": "s3"}
        for name, answers in checks.items():
            pid, ports = stack.pids[name], stack.ports[name]
            await asyncio.to_thread(stack.stop_server, name)
            assert not pid_alive(pid) and name not in stack.pids
            assert refuses(ports[main_port[name]])

            await asyncio.to_thread(stack.start_server, name)
            assert stack.ports[name] == ports and stack.addresses == a
            await answers()
        assert await nats_answers(a.nats_url) == 1  # the stream outlived the outage
    finally:
        await asyncio.to_thread(stack.stop)


LAST_THREAD_HOLDS_THE_PORT = r"""
#include <arpa/inet.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>
static void *hold(void *unused) { char c; (void)read(0, &c, 1); return unused; }  /* until stdin closes */
int main(int argc, char **argv) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[1]))};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(s, (struct sockaddr *)&a, sizeof a) || listen(s, 1)) return 1;
    pthread_t t;
    pthread_create(&t, NULL, hold, NULL);
    pthread_exit(NULL);  /* the main thread goes; the process and its port live on in the other thread */
}
"""


def test_a_server_whose_main_thread_is_gone_lives_until_its_last_thread_lets_go_of_its_port(tmp_path: Path) -> None:
    """A Go server stopping shows its main thread as a zombie while other threads still hold its ports: a restart
    that took that for gone found the ports taken and chose others (the stack's addresses changed)."""
    source, binary = tmp_path / "hold.c", tmp_path / "hold"
    source.write_text(LAST_THREAD_HOLDS_THE_PORT)
    subprocess.run(["gcc", "-pthread", "-o", str(binary), str(source)], check=True)
    port = free_port()
    proc = subprocess.Popen([str(binary), str(port)], stdin=subprocess.PIPE)
    try:
        wait_for_sync(lambda: proc_state(proc.pid) == "Z", DEADLINE_S, "the main thread to exit")
        assert pid_alive(proc.pid) and not port_is_free(port)
        assert proc.stdin is not None
        proc.stdin.close()  # the last thread returns: the process exits and its port is free
        wait_for_sync(lambda: not pid_alive(proc.pid), DEADLINE_S, "the process to be gone")
        assert port_is_free(port)
    finally:
        proc.kill()
        proc.wait()
