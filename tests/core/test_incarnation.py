"""Delivery tokens name the process that renews their lease; a gone process is recognised."""

from __future__ import annotations

import os
import subprocess
import sys

from celery_dedup import incarnation


def test_a_token_of_a_live_process_is_not_dead() -> None:
    assert not incarnation.died(incarnation.new_delivery_token())  # this very process
    parent = incarnation.new_delivery_token().replace(f".{os.getpid()}.", f".{os.getppid()}.")
    assert not incarnation.died(parent)


def test_a_token_of_a_process_that_exited_is_dead() -> None:
    made = subprocess.run(
        [sys.executable, "-c",
         "from celery_dedup.incarnation import new_delivery_token; print(new_delivery_token())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    token = made.stdout.strip()
    assert token.count(".") >= 2
    assert incarnation.died(token)


def test_tokens_from_elsewhere_are_never_taken_for_dead() -> None:
    """Another scope (machine, container), an old token, garbage: nothing is concluded."""
    mine = incarnation.new_delivery_token()
    _, pid_and_rest = mine.split(".", 1)
    assert not incarnation.died("0123456789." + pid_and_rest.replace(str(os.getpid()), "999999"))
    assert not incarnation.died("Zm9vYmFyYmF6cXV4cXV1eA")  # a token of 0.3
    assert not incarnation.died("")
    assert not incarnation.died(mine.split(".")[0] + ".notapid.x")
    assert not incarnation.died(mine.split(".")[0] + ".1.x")  # init is never gone
