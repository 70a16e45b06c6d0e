"""Fenced writes for Django models: a stale run's update is refused.

Give the model a ``FenceField`` and ``FencedManager`` (or a queryset of
``FencedQuerySet``); in a task with ``fence=True``::

    Payment.objects.filter(pk=payment_id).fenced_update(
        fence=current_fence(), status="captured"
    )

updates the row only while its stored token is not greater than the
run's (see ``celery_dedup.fence``), and stores the run's token with it.
"""

from __future__ import annotations

from typing import Any

from django.db import models

__all__ = ["FenceField", "FencedManager", "FencedQuerySet"]


class FenceField(models.BigIntegerField):  # type: ignore[misc]
    """The fencing token of the run that last wrote the row (``0``: none yet)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("default", 0)
        super().__init__(*args, **kwargs)

    def deconstruct(self) -> tuple[Any, ...]:
        name, path, args, kwargs = super().deconstruct()
        if kwargs.get("default") == 0:
            del kwargs["default"]
        return name, path, args, kwargs


class FencedQuerySet(models.QuerySet):  # type: ignore[misc]
    """A queryset whose ``fenced_update`` refuses rows a newer run wrote."""

    def fenced_update(self, *, fence: int, **values: Any) -> int:
        """``update(**values)`` of the rows whose token is at most ``fence``; they
        get ``fence`` as their token. One ``UPDATE``; returns how many rows it updated
        (the rows a newer run wrote are left as they are).
        """
        field = _fence_field(self.model)
        if field in values:
            raise ValueError(f"fenced_update: {field!r} is the token's field, not a value")
        fenced = self.filter(**{f"{field}__lte": int(fence)})
        return int(fenced.update(**{field: int(fence)}, **values))


#: A manager with ``fenced_update`` (``objects = FencedManager()``).
FencedManager = models.Manager.from_queryset(FencedQuerySet)


def _fence_field(model: Any) -> str:
    """The name of ``model``'s one ``FenceField``."""
    names = [f.name for f in model._meta.get_fields() if isinstance(f, FenceField)]
    if len(names) != 1:
        raise TypeError(
            f"{model.__name__} needs exactly one FenceField for fenced_update "
            f"(it has {len(names)})"
        )
    return str(names[0])
