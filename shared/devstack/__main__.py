"""`python -m shared.devstack --data-dir DIR`: start the stack, print its addresses as one JSON line, run until
SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from dataclasses import asdict
from pathlib import Path

from shared.devstack.stack import DevStack


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shared.devstack", description="Run the embedded servers.")
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--durable", action=argparse.BooleanOptionalAction, default=True,
                        help="--no-durable turns off fsync in postgres (for tests)")  # fmt: skip
    args = parser.parse_args(argv)

    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stopping.set())
    stack = DevStack(args.data_dir, durable=args.durable, log=lambda line: print(line, file=sys.stderr, flush=True))
    try:
        addresses = stack.start()
        print(json.dumps(asdict(addresses)), flush=True)
        stopping.wait()
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
