"""The responses a later request may continue (`previous_response_id`), kept in memory.

Bounded: the `max_stored_responses` most recently stored or continued responses (least
recently used first out), so a server that answers forever holds a fixed number of
conversations. Nothing survives a restart; a response created with `store: false` is never
kept. Read from the tokenizer threads (prompt rendering) and written from the event loop:
one lock guards it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from astrai.serve.errors import APIError


@dataclass(frozen=True)
class StoredResponse:
    """A finished response: its conversation as chat messages (input and output, without
    the instructions, which a continuation does not inherit) and the response object."""

    messages: list[dict[str, Any]]
    response: dict[str, Any]


class ResponseStore:
    """An LRU of `StoredResponse`s by response id, at most `capacity` of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = stored
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        """The stored response; a 400 naming `previous_response_id` when there is none."""
        with self._lock:
            found = self._items.get(response_id)
            if found is not None:
                self._items.move_to_end(response_id)
        if found is None:
            raise APIError(
                400,
                f"previous_response_id: no stored response {response_id!r} (unknown, created "
                f"with store: false, or evicted: this server keeps the last {self.capacity})",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return found
