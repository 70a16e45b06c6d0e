"""The producer's admission: how one ``apply_async`` call gets in, or is refused.

A call is admitted in one fixed order (DESIGN "Admission"):

1. resolve options and the key (pure: ``DedupTask.apply_async`` does it);
2. every check that can refuse: ``rate`` (a reservation in the rate window);
3. the ``lock``: acquire, take over (``replace``/``keep_last``) or cancel
   the holder (``cancel_running``);
4. ``publish``;
5. ``effects`` nothing can undo: dismiss or revoke a displaced holder.

Each of 2-4 is a ``Step``: ``enter`` either passes (having done its part,
whose undo it keeps) or answers a ``Refusal``. ``runner.admit`` runs them;
a refusal or an error runs the undos of the steps before it in reverse,
so a refused or failed call leaves the store as it found it. Where the
store offers it, 2 and 3 of a plain acquire are one round trip
(``rated``: the key looked at first, then the window, then both written). The canvas
rules (``canvas``) are applied once, by the runner, to every refusal.
"""

from __future__ import annotations

from .runner import admit, admit_unlocked
from .state import Admission, Refusal, Step

__all__ = ["Admission", "Refusal", "Step", "admit", "admit_unlocked"]
