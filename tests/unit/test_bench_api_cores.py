"""bench/api.py's placement of processes: each api under test on a core of its own, everything else on the others."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.api import cores, place, round_order


def test_cores_give_the_api_one_allowed_core_and_everything_else_the_rest() -> None:
    allowed = os.sched_getaffinity(0)
    assert cores(False) is None
    split = cores(True)
    if len(allowed) < 2:
        assert split is None  # nothing to split: every process shares the one core
        return
    assert split is not None
    api, others = split
    assert len(api) == 1
    assert api | others == allowed
    assert not api & others


def test_place_moves_every_thread_of_a_running_process() -> None:
    code = ("import threading, time\n"
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "print('up', flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        threads = os.listdir(f"/proc/{proc.pid}/task")
        assert len(threads) == 2
        target = {max(os.sched_getaffinity(0))}
        place(proc.pid, target)
        assert {tid: os.sched_getaffinity(int(tid)) for tid in threads} == {tid: target for tid in threads}
    finally:
        proc.kill()
        proc.wait()


def test_place_refuses_a_core_this_machine_does_not_have() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(OSError):
            place(proc.pid, {(os.cpu_count() or 1) + 64})
    finally:
        proc.kill()
        proc.wait()


def test_a_round_runs_every_path_symmetrically_about_its_middle() -> None:
    paths = ["a", "b", "c"]
    for mirrors in (1, 2, 3):
        for i in (0, 1):
            order = round_order(paths, i, mirrors)
            assert order == order[::-1]  # mirrored: each path's runs sit symmetrically about the middle
            assert all(order.count(p) == 2 * mirrors for p in paths)
            assert order[0] == (paths[0] if i % 2 == 0 else paths[-1])  # alternate rounds start at either end
