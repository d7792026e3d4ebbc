"""A set of request keys that forgets its oldest beyond a bound: what the ventilator (failed requests, whose queued
pieces it drops) and the sink (answered requests, whose late results it drops) remember, so a server up for months
does not grow with every request it ever saw."""

from __future__ import annotations

from collections import OrderedDict


class RecentKeys:
    """Forgetting is safe for both users: a forgotten failed request's leftover pieces run and the sink drops their
    results; a result arriving after its answered request is forgotten is far later than any re-send."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._keys: OrderedDict[tuple[bytes, bytes], None] = OrderedDict()

    def __contains__(self, key) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: tuple[bytes, bytes]) -> None:
        self._keys[key] = None
        if len(self._keys) > self.limit:
            self._keys.popitem(last=False)
