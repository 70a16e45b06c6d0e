"""Admin page of live locks, for whichever lock store the Celery app uses.

One page, one code path for every store: the changelist of ``DedupLock`` is
replaced by a view that reads ``store.scan(prefix)`` of the current Celery
app's store (the Django DB table, Redis, memcached…), so it shows the same
thing the task sees. It offers search (task name, key, holder id), a filter
by task, and the owner-checked action "Release selected locks": each lock is
released only if the holder shown on the page still holds it.

Access: staff (the admin site) plus the ``view`` (or ``change``) permission
on "deduplication lock" to list, and the ``delete`` permission to release.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from typing import Any, cast

from django.apps import apps
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, path, reverse
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from ...api import release
from ...runtime import runtime_for
from ...stores.base import Lock, LockStore
from .models import DedupLock

__all__ = ["DedupLockAdmin", "LockRow"]

logger = logging.getLogger("celery_dedup")

#: rows shown at most; narrow with search or the task filter
MAX_ROWS = 1000


class LockRow:
    """One lock as the page shows it."""

    def __init__(self, lock: Lock, result_url: str | None) -> None:
        self.lock = lock
        self.task_name = lock.task_name
        self.key = lock.key
        self.digest = lock.key.rsplit(":", 1)[-1][:16]
        self.owner = lock.task_id
        self.policy = lock.policy
        self.expires_in = _duration(lock.ttl)
        self.result_url = result_url
        #: the checkbox value: key and the holder seen, for the owner check
        self.value = json.dumps([lock.key, lock.task_id])


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{days}d"] if days else []
    if hours or days:
        parts.append(f"{hours}h")
    if not days:
        parts.append(f"{minutes}m")
    if not days and not hours:
        parts.append(f"{secs}s")
    return " ".join(parts)


def _current_celery_app() -> Any:
    from celery import current_app

    return cast(Any, current_app)._get_current_object()


@admin.register(DedupLock)
class DedupLockAdmin(admin.ModelAdmin):  # type: ignore[misc]
    """Live locks of the current Celery app's lock store, with an owner-checked release."""

    change_list_template = "admin/celery_dedup/locks.html"
    actions = ["release_selected"]
    #: the Celery app whose store is shown; ``None`` means ``celery.current_app``
    celery_app: Any = None

    # Only the changelist exists: locks are not edited, and may not be rows.
    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Locks are taken by tasks, never added by hand."""
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Locks are read-only; ``change`` permission still lets a user list them."""
        return False

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """``view_deduplock`` or ``change_deduplock``."""
        opts = self.opts
        user = request.user
        return bool(
            user.has_perm(f"{opts.app_label}.view_{opts.model_name}")
            or user.has_perm(f"{opts.app_label}.change_{opts.model_name}")
        )

    def get_urls(self) -> list[Any]:
        """Just the changelist."""
        info = self.opts.app_label, self.opts.model_name
        view = self.admin_site.admin_view(self.changelist_view)
        return [path("", view, name="{}_{}_changelist".format(*info))]

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        """Our release action only (no generic "delete selected")."""
        actions: dict[str, Any] = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    # -- the store ---------------------------------------------------------

    def get_store(self) -> tuple[LockStore | None, str, Any]:
        """``(store, key prefix, app)`` of the Celery app this page shows."""
        app = self.celery_app or _current_celery_app()
        runtime = runtime_for(app)
        return runtime.store, runtime.settings.key_prefix + ":", app

    # -- the action --------------------------------------------------------

    @admin.action(  # type: ignore[untyped-decorator]
        description=_("Release selected locks"), permissions=["delete"]
    )
    def release_selected(self, request: HttpRequest, selected: Sequence[tuple[str, str]]) -> None:
        """Release each selected lock if the holder shown still holds it (owner-checked)."""
        _store, _prefix, app = self.get_store()
        released = 0
        for key, owner in selected:
            if release(key, owner=owner, app=app):
                released += 1
                logger.info(
                    "celery-dedup: %s released lock %s of %s from the admin",
                    request.user, key.rsplit(":", 1)[-1][:16], owner,
                )
        self.message_user(
            request,
            ngettext("Released %(n)d lock.", "Released %(n)d locks.", released) % {"n": released},
            messages.SUCCESS,
        )
        kept = len(selected) - released
        if kept:
            self.message_user(
                request,
                ngettext(
                    "%(n)d lock was not released: it expired or has a new holder.",
                    "%(n)d locks were not released: they expired or have a new holder.",
                    kept,
                )
                % {"n": kept},
                messages.WARNING,
            )

    # -- the page ----------------------------------------------------------

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """List live locks (search, task filter) and run the release action."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        if request.method == "POST":
            return self._run_action(request)
        store, prefix, _app = self.get_store()
        locks = list(store.scan(prefix)) if store is not None else []
        task_names = sorted({lock.task_name for lock in locks})
        query = request.GET.get("q", "").strip()
        task = request.GET.get("task", "")
        shown = [lock for lock in locks if _matches(lock, query, task)]
        truncated = len(shown) > MAX_ROWS
        shown = shown[:MAX_ROWS]
        result_urls = self._result_urls(lock.task_id for lock in shown)
        actions = self.get_actions(request)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": _("Live deduplication locks"),
            "subtitle": None,
            "store": store,
            "prefix": prefix,
            "rows": [LockRow(lock, result_urls.get(lock.task_id)) for lock in shown],
            "total": len(locks),
            "truncated": truncated,
            "max_rows": MAX_ROWS,
            "task_names": task_names,
            "task": task,
            "query": query,
            "action_choices": [(name, desc) for name, (_f, _n, desc) in actions.items()],
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
            "has_view_permission": True,
            **(extra_context or {}),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.change_list_template, context)

    def _run_action(self, request: HttpRequest) -> HttpResponse:
        actions = self.get_actions(request)
        name = request.POST.get("action", "")
        if name not in actions:
            if name:
                raise PermissionDenied
            self.message_user(request, _("No action selected."), messages.WARNING)
            return HttpResponseRedirect(request.get_full_path())
        selected = _parse_selected(request.POST.getlist(ACTION_CHECKBOX_NAME))
        if not selected:
            self.message_user(
                request,
                _("Items must be selected in order to perform actions on them."),
                messages.WARNING,
            )
        else:
            func = actions[name][0]
            func(self, request, selected)
        return HttpResponseRedirect(request.get_full_path())

    def _result_urls(self, owners: Iterable[str]) -> dict[str, str]:
        """Admin links to the holders' results, when django-celery-results stores them."""
        if not apps.is_installed("django_celery_results"):
            return {}
        from django_celery_results.models import TaskResult

        owners = list(owners)
        if not owners:
            return {}
        urls: dict[str, str] = {}
        for task_id, pk in TaskResult.objects.filter(task_id__in=owners).values_list(
            "task_id", "pk"
        ):
            try:
                urls[task_id] = reverse(
                    "admin:django_celery_results_taskresult_change",
                    args=[pk],
                    current_app=self.admin_site.name,
                )
            except NoReverseMatch:
                return {}
        return urls


def _matches(lock: Lock, query: str, task: str) -> bool:
    if task and lock.task_name != task:
        return False
    if not query:
        return True
    query = query.lower()
    return any(query in field.lower() for field in (lock.task_name, lock.key, lock.task_id))


def _parse_selected(values: Iterable[str]) -> list[tuple[str, str]]:
    selected = []
    for value in values:
        try:
            key, owner = json.loads(value)
        except (ValueError, TypeError):
            continue
        if isinstance(key, str) and isinstance(owner, str):
            selected.append((key, owner))
    return selected
