"""The lock and counter tables of the Django DB lock store (``django-db``)."""

from __future__ import annotations

import time

from django.db import models
from django.utils.translation import gettext_lazy as _

from .managers import CounterManager, LockManager

__all__ = ["DedupCounter", "DedupGateWaiter", "DedupLock"]


class DedupLock(models.Model):  # type: ignore[misc]
    """One held (or expired, not yet reused) lock, or a revoked marker.

    Times are epoch seconds by the database's clock; a row whose
    ``expires_at`` has passed is free and is taken over by the next acquire.
    Revoked markers (``policy == "revoked"``, keyed by
    ``revoked_marker_key``) share the table: ``objects`` never returns them,
    ``all_rows`` does.
    """

    key = models.CharField(
        _("key"),
        max_length=512,
        primary_key=True,
        help_text=_("{prefix}:{task name}:{sha256 of the call's identity}"),
    )
    owner = models.CharField(
        _("owner token"),
        max_length=255,
        help_text=_("Random per publish: only the holder's message knows it."),
    )
    token = models.CharField(
        _("lease token"),
        max_length=32,
        help_text=_("Random per acquire: tells the acquirer whether it got the lock."),
    )
    task_name = models.CharField(_("task name"), max_length=255)
    policy = models.CharField(_("unique until"), max_length=16)
    task_id = models.CharField(
        _("holder task id"),
        max_length=255,
        blank=True,
        default="",
        help_text=_("Empty on rows written by 0.1.0, whose owner was the task id."),
    )
    started = models.BooleanField(
        _("started"), default=False, help_text=_("The holder's message passed its start check.")
    )
    acquired_at = models.FloatField(_("acquired at (epoch seconds)"))
    expires_at = models.FloatField(_("expires at (epoch seconds)"))

    #: locks only (revoked markers excluded): use it for any listing or count
    objects = LockManager()
    #: every row, revoked markers included (maintenance, flushing a test database)
    all_rows = models.Manager()

    class Meta:
        db_table = "celery_dedup_lock"
        verbose_name = _("deduplication lock")
        verbose_name_plural = _("deduplication locks")
        ordering = ("key",)
        indexes = (
            models.Index(fields=["expires_at"], name="celery_dedup_lock_expires"),
            models.Index(fields=["task_name"], name="celery_dedup_lock_task"),
        )

    def __str__(self) -> str:
        return str(self.key)

    @property
    def expires_in(self) -> float:
        """Seconds left by this process's clock (approximate; the store uses the DB clock)."""
        return max(0.0, float(self.expires_at) - time.time())


class DedupCounter(models.Model):  # type: ignore[misc]
    """A shared metric counter: what celery-dedup did, per task and event."""

    prefix = models.CharField(_("key prefix"), max_length=200)
    task_name = models.CharField(_("task name"), max_length=255)
    event = models.CharField(_("event"), max_length=32)
    count = models.BigIntegerField(_("count"), default=0)

    objects = CounterManager()

    class Meta:
        db_table = "celery_dedup_counter"
        verbose_name = _("deduplication counter")
        verbose_name_plural = _("deduplication counters")
        constraints = (
            models.UniqueConstraint(
                fields=["prefix", "task_name", "event"], name="celery_dedup_counter_unique"
            ),
        )

    def __str__(self) -> str:
        return f"{self.task_name} {self.event}: {self.count}"


class DedupGateWaiter(models.Model):  # type: ignore[misc]
    """The ``keep_last`` follow-up waiting at a key's run gate (``GateWaiters``).

    One row per gate with a waiter: the follow-up's message, published at
    once by the worker whose run opens the gate. A newer follow-up replaces
    the row; a row past ``expires_at`` is ignored (its message's deferred
    copy came back on its own) and purged with expired locks.
    """

    key = models.CharField(_("gate key"), max_length=512, primary_key=True)
    payload = models.TextField(_("message (base64)"))
    expires_at = models.FloatField(_("expires at (epoch seconds)"))

    class Meta:
        db_table = "celery_dedup_gate_wait"
        verbose_name = _("run gate waiter")
        verbose_name_plural = _("run gate waiters")
        indexes = (models.Index(fields=["expires_at"], name="celery_dedup_gate_wait_exp"),)

    def __str__(self) -> str:
        return str(self.key)
