"""auth with `auth.check` served by its FastStream subscriber (max_workers, FastStream's per-message pipeline) instead
of the batched subscription (services/auth/batched.py): what the seam buys, measured by bench/auth.py and bench/api.py
in the same run. Never a way to run Weir.

python -m bench.auth_unbatched   (the same WEIR_* settings as python -m services.auth)
"""

from __future__ import annotations

from typing import Any

from services.auth import app, batched
from services.auth.batched import CheckBatcher
from shared.runtime import main


def keep_faststream_subscription(subscriber: Any, batcher: CheckBatcher) -> None:
    """The seam left out: the subscriber opens its own subscription at start, as any FastStream subscriber does."""


if __name__ == "__main__":
    batched.serve_in_batches = keep_faststream_subscription
    main(app.SERVICE)
