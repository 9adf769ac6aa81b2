"""The api's pages (services/api/demo.py): what `weir up` tells them, put into the HTML safely."""

from __future__ import annotations

import json
import re

from services.api.demo import demo_page, index_page, service_pages


def _config(page: str) -> dict[str, object]:
    m = re.search(r'<script type="application/json" id="weir-demo-config">(.*?)</script>', page, re.S)
    assert m is not None
    parsed: dict[str, object] = json.loads(m.group(1))
    return parsed


def test_the_demo_page_carries_the_publishable_key_or_none() -> None:
    assert _config(demo_page("wpk_" + "a" * 32)) == {"publishableKey": "wpk_" + "a" * 32}
    assert _config(demo_page("")) == {"publishableKey": None}


def test_a_key_cannot_end_the_config_script_early() -> None:
    page = demo_page("</script><script>alert(1)</script>")
    assert "<script>alert(1)" not in page
    assert _config(page) == {"publishableKey": "</script><script>alert(1)</script>"}


def test_service_pages_are_name_equals_url_and_the_rest_is_skipped() -> None:
    assert service_pages("") == {}
    assert service_pages(" auth=http://127.0.0.1:1/ ,encode=http://127.0.0.1:2,bad,x=ftp://h,=http://y") == {
        "auth": "http://127.0.0.1:1", "encode": "http://127.0.0.1:2"}


def test_the_index_links_each_service_and_escapes_what_it_is_given() -> None:
    page = index_page({"auth": "http://127.0.0.1:1", "m<1>": 'http://h/"x'})
    assert '<li><a href="/asyncapi">api</a></li>' in page
    assert '<a href="http://127.0.0.1:1/asyncapi">auth</a>' in page
    assert "m&lt;1&gt;" in page and 'http://h/&quot;x/asyncapi' in page and "<1>" not in page
