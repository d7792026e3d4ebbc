"""Admission to the fleet's queue: the queue is bounded, and a request beyond the bound is refused at once with
a busy reply instead of waiting into the client's timeout.

HTTP requests are bounded at the HTTP front end (``--max-concurrent-requests``: 429 with Retry-After). ZeroMQ
requests are bounded here, against the requests waiting in the fleet's queue (ZeroMQ and HTTP alike: a request
counts from its arrival until its last piece goes to a worker; ``FairQueue.requests``). The refusal is an error
reply whose message starts with ``protocol.BUSY_PREFIX``: bert-serving-client raises it (numpy's refusal of the
message as a dtype names it) and bertopt's ``Client`` raises ``ServerBusy``.

The check knows nothing of sockets or models: one ``Admission`` guards one queue, so a fleet with one queue per
model keeps one per model.
"""

from __future__ import annotations

from dataclasses import dataclass

from bertopt.protocol import BUSY_PREFIX


def busy_message(queued: int, limit: int) -> str:
    return (f"{BUSY_PREFIX}{queued} requests are waiting, this server's limit (--max-queued-requests {limit}); "
            "the request did not run: send it again shortly, or start the server with more --num-worker or a "
            "larger --max-queued-requests")


@dataclass
class Admission:
    """A bounded queue's admission check: ``check(queued)`` is None (admit) or the busy message to reply with."""

    limit: int
    refused: int = 0

    def check(self, queued: int) -> str | None:
        if queued < self.limit:
            return None
        self.refused += 1
        return busy_message(queued, self.limit)
