"""``debounce_max_wait``: a ``replace`` debounce still runs under constant traffic.

A *burst* starts with the call that finds its key free (or held by a run
already in progress) and lasts while calls keep replacing the queued
message. Each call of a burst, its first included, is published with its
ETA capped at ``burst start + debounce_max_wait``, so the burst runs at most
``debounce_max_wait`` seconds after its first call, with the arguments of
its last call.

The burst start travels in the owner token (``owner_token``, in ms, hex):
every store keeps the token as an opaque string and ``take_over`` answers
with the displaced holder's token, so the cap costs no store round trip
and no schema change. The secret part is unchanged (128 random bits).

The token is written by ``take_over`` before the displaced holder's burst
start is known: the call guesses it from the last burst this process saw
for the key (right whenever one process makes the burst's calls) and, when
the guess was wrong, takes the key once more under the right token (one
more round trip, for that call only).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, MutableMapping
from datetime import datetime, timezone
from typing import Any

from . import owner_token as tokens
from .stores.base import Lock, LockStore, replace_holder

__all__ = ["burst_start", "cap_eta", "guess_owner", "settle_owner"]

#: bursts this process saw last, per key (bounded: a guess, never a truth)
_recent: OrderedDict[str, float] = OrderedDict()
_recent_lock = threading.Lock()
_MAX_REMEMBERED = 4096


def owner_token(start: float) -> str:
    """A fresh owner token carrying the burst start ``start`` (epoch seconds)."""
    return tokens.mint(**{tokens.BURST_START: f"{int(start * 1000):x}"})


def token_start(owner: str) -> float | None:
    """The burst start a token carries, or ``None`` (a token of another policy)."""
    found = tokens.facts_of(owner).get(tokens.BURST_START)
    if found is None:
        return None
    try:
        return int(found, 16) / 1000
    except ValueError:
        return None


def burst_start(previous: Lock | None, now: float) -> float:
    """When the burst this call belongs to started.

    A free key, or one held by a run already in progress, starts a new
    burst; a queued holder's burst continues (a holder without a burst in
    its token started it when it took the key).
    """
    if previous is None or previous.started:
        return now
    start = token_start(previous.owner)
    return min(now, previous.acquired_at if start is None else start)


def guess_owner(key: str, max_wait: float, now: float) -> str:
    """The token to take ``key`` with: this process's last burst on it, if still open."""
    with _recent_lock:
        start = _recent.get(key)
    if start is None or start + max_wait < now:
        start = now
    return owner_token(start)


def _remember(key: str, start: float) -> None:
    with _recent_lock:
        _recent[key] = start
        _recent.move_to_end(key)
        while len(_recent) > _MAX_REMEMBERED:
            _recent.popitem(last=False)


def settle_owner(
    store: LockStore,
    key: str,
    guessed: str,
    previous: Lock | None,
    ttl: float,
    meta: Mapping[str, str],
    now: float,
    revoked_ttl: float,
) -> tuple[str, float]:
    """After ``take_over(key, guessed)`` displaced ``previous``: the owner this call publishes.

    Returns ``(owner, burst start)``. When the guessed burst start was
    wrong, the key is taken again under the right token. A concurrent call
    that took the key in between is replaced as by any ``replace``: its
    owner token is marked revoked (its message, if it publishes one, is
    refused at start). Handing the key back to it instead could leave it
    to nobody: that call may itself be settling, and hand the key back to
    this one.
    """
    start = burst_start(previous, now)
    _remember(key, start)
    if token_start(guessed) == int(start * 1000) / 1000:
        return guessed, start
    owner = owner_token(start)
    # (The guessed token is revoked too when it is the one displaced: no
    # message carries it.)
    replace_holder(store, key, owner, ttl, meta, revoked_ttl)
    return owner, start


def cap_eta(options: MutableMapping[str, Any], start: float, max_wait: float,
            now: Callable[[], float] = time.time, floor: float | None = None) -> bool:
    """Cap the call's ``countdown``/``eta`` at ``start + max_wait``; whether it was capped.

    Never earlier than ``floor`` (a place the call reserved in a rate window:
    running before it would exceed the rate).
    """
    countdown, eta = options.get("countdown"), options.get("eta")
    if countdown:
        wanted = now() + float(countdown)
    elif eta is not None:
        when = datetime.fromisoformat(eta) if isinstance(eta, str) else eta
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        wanted = when.timestamp()
    else:
        return False
    cap = max(start + max_wait, floor or 0.0)
    if wanted <= cap:
        return False
    options.pop("countdown", None)
    options["eta"] = datetime.fromtimestamp(cap, tz=timezone.utc)
    return True
