"""Hypothesis strategies for auth.check's replies: text that looks like the reply's own JSON, identities, replies."""

from __future__ import annotations

from hypothesis import strategies as st

from shared.authcheck import CheckReply, Identity

TEXT = st.text(max_size=30) | st.sampled_from([',"headers":', '"}', "\\", '"key";r=9;t=60', ""])
IDENTITIES = st.none() | st.builds(
    Identity, account_id=st.none() | TEXT, app_id=st.none() | TEXT, key_id=st.none() | TEXT,
    key_type=st.none() | st.sampled_from(["secret", "publishable", "upload_token", "account_token", "internal"]),
    video_id=st.none() | TEXT, allowed_origins=st.tuples(TEXT) | st.just(()),
)
REPLIES = st.builds(
    CheckReply, allowed=st.booleans(), status=st.sampled_from([200, 401, 403, 429, 503]),
    problem=st.none() | st.dictionaries(TEXT, TEXT | st.integers(), max_size=4),
    headers=st.dictionaries(TEXT, TEXT, max_size=6), identity=IDENTITIES, client_address=TEXT,
    counter_mode=st.sampled_from(["shared", "local"]), cors_origin=st.none() | TEXT,
)
