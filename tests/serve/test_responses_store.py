"""The bounded store behind `previous_response_id`."""

from __future__ import annotations

import pytest

from astrai.serve.errors import APIError
from astrai.serve.responses_store import ResponseStore, StoredResponse


def _stored(i: int) -> StoredResponse:
    return StoredResponse([{"role": "user", "content": str(i)}], {"id": f"resp_{i}"})


def test_least_recently_used_is_evicted():
    store = ResponseStore(2)
    store.put("a", _stored(1))
    store.put("b", _stored(2))
    assert store.get("a").messages[0]["content"] == "1"  # a is now the most recent
    store.put("c", _stored(3))
    assert len(store) == 2
    with pytest.raises(APIError) as info:
        store.get("b")
    assert info.value.status == 400 and info.value.param == "previous_response_id"
    assert store.get("a").response["id"] == "resp_1"
    assert store.get("c").response["id"] == "resp_3"


def test_zero_keeps_nothing():
    store = ResponseStore(0)
    store.put("a", _stored(1))
    assert len(store) == 0
    with pytest.raises(APIError):
        store.get("a")
