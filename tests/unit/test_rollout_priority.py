"""A rollout's new instance starts under SCHED_IDLE and niced, its session's autogroup too (weir/up.py
`_child_setup`) and, once ready, every thread of its process group and its autogroup go back to the normal policy
at `weir up`'s nice (weir/rollout.py `normal_priority`); its start's CPU cap (weir/cpucap.py) holds and comes off."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.waiting import wait_for_sync
from weir.cpucap import CpuCap, CpuCapUnavailable
from weir.rollout import RolloutSettings, autogroup_nice, normal_priority
from weir.up import _child_setup

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="only root may set a priority back (weir rollout too)")

# Whether a new session gets an autogroup here: not when they are off, nor inside a non-root cpu cgroup (sched(7)).
# Asked of a fresh session, not of this process: a process in init's session shows none even when they are on.
AUTOGROUPS = subprocess.run([sys.executable, "-c", "print(open('/proc/self/autogroup').read())"], capture_output=True,
                            text=True, start_new_session=True).stdout.strip() != ""
THREADS = 3  # started by the child after its start, so they inherit its policy and nice
CHILD = f"""
import subprocess, sys, threading, time
for _ in range({THREADS}):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a process of its group (as ffmpeg)
print("started", flush=True)
time.sleep(60)
"""


def _threads_of_group(pgid: int) -> list[int]:
    tids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and _pgid(int(name)) == pgid:
            tids += [int(t) for t in os.listdir(f"/proc/{name}/task")]
    return tids


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def test_every_thread_of_the_new_instance_group_goes_back_to_the_normal_policy_and_weir_ups_nice() -> None:
    start_nice = RolloutSettings().start_nice
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, start_new_session=True,
                            preexec_fn=_child_setup(start_nice, idle=True))
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"started\n"
        wait_for_sync(lambda: len(_threads_of_group(proc.pid)) >= THREADS + 2, timeout=10, what="its threads")
        tids = _threads_of_group(proc.pid)
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert all(os.sched_getscheduler(t) == os.SCHED_IDLE for t in tids)
        assert all(os.getpriority(os.PRIO_PROCESS, t) == min(ours + start_nice, 19) for t in tids)
        # its session's autogroup too: across sessions only the autogroup's nice counts (none without autogroups)
        assert autogroup_nice(proc.pid) in ({start_nice} if AUTOGROUPS else {None})

        normal_priority(proc.pid)

        assert [os.sched_getscheduler(t) for t in tids] == [os.SCHED_OTHER] * len(tids)
        assert [os.getpriority(os.PRIO_PROCESS, t) for t in tids] == [ours] * len(tids)
        assert autogroup_nice(proc.pid) in ({0} if AUTOGROUPS else {None})
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


SPIN = "import time\nwhile True: pass"


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_capped_start_gets_at_most_its_share_of_a_cpu_and_goes_home_once_released() -> None:
    share = RolloutSettings().start_cpu_share
    try:
        cap = CpuCap.create(f"weir-test-cap-{os.getpid()}", share)
    except CpuCapUnavailable as exc:
        pytest.skip(f"no CPU cap on this machine: {exc}")
    proc = subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=True,
                            preexec_fn=_child_setup(0, cap=cap))
    try:
        assert cap.members() == [proc.pid]
        window = 1.0
        before, t0 = _cpu_seconds(proc.pid), time.monotonic()
        time.sleep(window)
        used = (_cpu_seconds(proc.pid) - before) / (time.monotonic() - t0)
        assert used <= share * 1.5, f"a spinning process in the cap used {used:.2f} of a CPU (cap {share})"

        cap.release()

        assert not cap.path.exists()
        before, t0 = _cpu_seconds(proc.pid), time.monotonic()
        time.sleep(window)
        assert (_cpu_seconds(proc.pid) - before) / (time.monotonic() - t0) > share * 2, "still capped after release"
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
        cap.release()


def test_a_capped_start_still_gets_its_share_of_a_saturated_machine() -> None:
    """Only the quota bounds the cap: beside a spinner per CPU the start still runs near its share (with the least
    cgroup weight it got next to nothing, and a start on a busy machine ran past the ready timeout)."""
    share = RolloutSettings().start_cpu_share
    try:
        cap = CpuCap.create(f"weir-test-cap-{os.getpid()}", share)
    except CpuCapUnavailable as exc:
        pytest.skip(f"no CPU cap on this machine: {exc}")
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=True)
                for _ in range(os.cpu_count() or 1)]
    proc = subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=True,
                            preexec_fn=_child_setup(0, cap=cap))
    try:
        time.sleep(0.3)  # past the interpreters' start
        before, t0 = _cpu_seconds(proc.pid), time.monotonic()
        time.sleep(1.5)
        used = (_cpu_seconds(proc.pid) - before) / (time.monotonic() - t0)
        assert used >= share / 2, f"the capped start got {used:.3f} of a CPU beside the spinners (cap {share})"
    finally:
        for p in [*spinners, proc]:
            os.killpg(p.pid, 9)
            p.wait()
        cap.release()
