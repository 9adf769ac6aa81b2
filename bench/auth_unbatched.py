"""auth with `auth.check` served by a FastStream subscriber (max_workers, FastStream's per-message pipeline) instead
of the batched plain subscription (services/auth/batched.py): what the batching buys, measured by bench/auth.py and
bench/api.py in the same run. Never a way to run Weir.

python -m bench.auth_unbatched   (the same WEIR_* settings as python -m services.auth)
"""

from __future__ import annotations

import dataclasses

from services.auth import app
from services.auth.settings import AuthSettings
from shared.authcheck import CHECK_SUBJECT, QUEUE_GROUP, CheckReply, CheckRequest
from shared.runtime import Runtime, main


async def start_on_faststream(rt: Runtime) -> None:
    """auth as it starts, its auth.check subscription swapped for a FastStream subscriber (started by the broker)."""
    await app.start(rt)
    for subscription in rt.subscriptions:
        await subscription.unsubscribe()
    rt.subscriptions.clear()
    checker = rt.parts_of(app.AuthParts).checker
    assert rt.broker is not None and isinstance(rt.settings, AuthSettings)

    @rt.broker.subscriber(CHECK_SUBJECT, queue=QUEUE_GROUP, max_workers=rt.settings.check_concurrency)
    async def check(request: CheckRequest) -> CheckReply:
        return await checker.check(request)


if __name__ == "__main__":
    main(dataclasses.replace(app.SERVICE, on_start=start_on_faststream))
