"""Token-budget batching, shared by the ZeroMQ and HTTP front ends (pure bookkeeping, no sockets).

* ``cut_request``: a request is cut into *pieces* of at most ``max_tokens`` tokens (and ``max_texts`` texts),
  in input order. Counting tokens, not texts, is what bounds a mini-job's run time: 256 paragraphs take a
  hundred times longer than 256 short sentences, and a small request queued behind either waits for it.
* ``FairQueue``: pieces wait in per-client FIFO queues served round-robin, so a client with 10,000 queued
  pieces gets one turn, then the next client gets one.
* ``pack``: when a worker lane is free, pieces from the queue's head (any clients, in round-robin order) are
  packed into one mini-job up to the token and text budget, so many one-sentence requests run as one batch.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

# what a piece carries: plain texts, (first, second) pairs, token-id lists, or predict objects
# ({"text", "pair", "aggregation"}: Client.predict, answered with the task's JSON results), or texts to chunk
# (a text over the window runs as overlapping windows, pooled: Predictor.run(long_inputs="chunk"))
KIND_TEXT, KIND_PAIR, KIND_IDS, KIND_PREDICT, KIND_CHUNK = b"t", b"p", b"i", b"r", b"c"
KINDS = (KIND_TEXT, KIND_PAIR, KIND_IDS, KIND_PREDICT, KIND_CHUNK)
# not a request: the HTTP front end's word that the client of one of its requests stopped waiting
KIND_CANCEL = b"x"


@dataclass
class Piece:
    """A slice of one request: ``items[k]`` is the request's text number ``offset + k``."""

    identity: bytes
    request_id: bytes
    index: int  # this piece's number within its request
    n_pieces: int
    n_texts: int  # texts in the whole request
    offset: int
    items: list[Any]
    tokens: int
    kind: bytes = KIND_TEXT
    attempts: int = 0
    enqueued: float = field(default_factory=time.monotonic)

    @property
    def key(self) -> tuple[bytes, bytes]:
        return (self.identity, self.request_id)

    @property
    def size(self) -> int:
        return len(self.items)


def cut_request(identity: bytes, request_id: bytes, items: list[Any], lengths: list[int], max_tokens: int,
                max_texts: int, kind: bytes = KIND_TEXT) -> list[Piece]:
    """Consecutive pieces of at most ``max_tokens`` tokens and ``max_texts`` texts (a text longer than the
    budget is a piece of its own)."""
    bounds: list[tuple[int, int, int]] = []  # (start, stop, tokens)
    start, tokens = 0, 0
    for i, length in enumerate(lengths):
        if i > start and (i - start >= max_texts or tokens + length > max_tokens):
            bounds.append((start, i, tokens))
            start, tokens = i, 0
        tokens += length
    if len(items) > start:
        bounds.append((start, len(items), tokens))
    n = len(items)
    return [Piece(identity, request_id, index, len(bounds), n, a, items[a:b], t, kind)
            for index, (a, b, t) in enumerate(bounds)]


class FairQueue:
    """Per-client FIFO queues served round-robin, one piece per client per turn."""

    def __init__(self) -> None:
        self._queues: dict[bytes, deque] = {}
        self._turns: deque[bytes] = deque()
        self._len = 0
        self.tokens = 0
        # requests with work still queued: a request's pieces are pushed and popped in order, so it is queued
        # while its last piece is (what a bounded queue counts, see serve/admission.py)
        self.requests = 0

    def __len__(self) -> int:
        return self._len

    def push(self, piece: Piece, front: bool = False) -> None:
        q = self._queues.get(piece.identity)
        if q is None:
            q = self._queues[piece.identity] = deque()
            # a client's re-sent work (front) goes first in the rotation too
            (self._turns.appendleft if front else self._turns.append)(piece.identity)
        (q.appendleft if front else q.append)(piece)
        self._len += 1
        self.tokens += piece.tokens
        self.requests += piece.index == piece.n_pieces - 1

    def peek(self) -> Piece:
        return self._queues[self._turns[0]][0]

    def pop(self) -> Piece:
        identity = self._turns.popleft()
        q = self._queues[identity]
        piece = q.popleft()
        self._len -= 1
        self.tokens -= piece.tokens
        self.requests -= piece.index == piece.n_pieces - 1
        if q:
            self._turns.append(identity)
        else:
            del self._queues[identity]
        return piece

    def clients(self) -> int:
        return len(self._queues)

    def remove(self, identity: bytes) -> list[Piece]:
        """Take out every piece queued for ``identity`` (a request whose client stopped waiting)."""
        q = self._queues.pop(identity, None)
        if q is None:
            return []
        self._turns.remove(identity)
        for piece in q:
            self._len -= 1
            self.tokens -= piece.tokens
            self.requests -= piece.index == piece.n_pieces - 1
        return list(q)


def pack(queue: FairQueue, max_tokens: int, max_texts: int, skip=lambda piece: False) -> list[Piece]:
    """Pop the next piece and every following one (round-robin order) of the same kind that still fits the
    budget; pieces for which ``skip`` is true (their request already failed) are dropped on the way."""
    batch: list[Piece] = []
    tokens = texts = 0
    while queue:
        nxt = queue.peek()
        if skip(nxt):
            queue.pop()
            continue
        # predict pieces are not packed with other requests' (each request has its own pair / aggregation)
        if batch and (nxt.kind != batch[0].kind or tokens + nxt.tokens > max_tokens
                      or texts + nxt.size > max_texts or nxt.kind == KIND_PREDICT):
            break
        batch.append(queue.pop())
        tokens += nxt.tokens
        texts += nxt.size
    return batch
