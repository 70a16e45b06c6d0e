"""Admin page of live locks, for whichever lock store the Celery app uses.

One page, one code path for every store: the changelist of ``DedupLock`` is
replaced by a view that reads ``store.scan(prefix)`` of the current Celery
app's store (the Django DB table, Redis, memcached…), so it shows the same
thing the task sees. It offers search (task name, key, holder id), a filter
by task, a lookup of the lock a call would take (task and arguments), the
holder's state per row, and the action "Release selected locks", which
shows a confirmation page first. The rules are the CLI's
(``celery_dedup.cli.assess``): a lock its policy still needs (holder not
finished, or kept by ``unique_until`` after it finished) is only released
when the confirmation page's "release them anyway" box is ticked, and every
release is owner-checked against the holder shown.

Access: staff (the admin site) plus the ``view`` (or ``change``) permission
on "deduplication lock" to list, and the ``delete`` permission to release.

A second, read-only page (``limits/``, linked from the locks page) lists
the live per-key limits, as ``celery dedup limits`` does: each concurrency
key with its slots in use and each rate key with its publishes in the
window, by task and key digest. Same access as the list; it changes nothing.
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

from ...api import dedup_key_for, release
from ...cli import Assessment, assess, duration
from ...exceptions import DedupError, ScanNotSupported, StoreUnavailable
from ...limits import live_keys
from ...runtime import runtime_for
from ...stores.base import Lock, LockStore
from .discovery import import_task_modules
from .models import DedupLock

__all__ = ["DedupLockAdmin", "LockRow"]

logger = logging.getLogger("celery_dedup")

#: rows per page; narrow with search, the task filter or the lookup
PER_PAGE = 100


class LockRow:
    """One lock as the pages show it."""

    def __init__(self, found: Assessment, result_url: str | None) -> None:
        lock = found.lock
        self.lock = lock
        self.task_name = lock.task_name
        self.key = lock.key
        self.digest = lock.key.rsplit(":", 1)[-1][:16]
        self.owner = lock.task_id
        self.policy = lock.policy
        self.expires_in = duration(lock.ttl)
        self.state = found.state
        self.phase = found.phase
        self.needed = found.needed
        self.why = found.why
        self.result_url = result_url
        #: the checkbox value: key and the holder seen, for the owner check
        self.value = json.dumps([lock.key, lock.task_id])


def _current_celery_app() -> Any:
    from celery import current_app

    return cast(Any, current_app)._get_current_object()


@admin.register(DedupLock)
class DedupLockAdmin(admin.ModelAdmin):  # type: ignore[misc]
    """Live locks of the current Celery app's store, with a confirmed, owner-checked release."""

    change_list_template = "admin/celery_dedup/locks.html"
    limits_template = "admin/celery_dedup/limits.html"
    release_confirmation_template = "admin/celery_dedup/release_confirmation.html"
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
        """The changelist and the read-only page of per-key limits."""
        info = self.opts.app_label, self.opts.model_name
        view = self.admin_site.admin_view(self.changelist_view)
        limits = self.admin_site.admin_view(self.limits_view)
        return [
            path("", view, name="{}_{}_changelist".format(*info)),
            path("limits/", limits, name="{}_{}_limits".format(*info)),
        ]

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

    def _import_tasks(self, request: HttpRequest, app: Any) -> None:
        """Import the app's task modules, as a worker does, before listing its tasks.

        Celery's Django layout imports them lazily: under ``runserver``
        only those some view imported would be known to the lookup.
        """
        try:
            import_task_modules(app)
        except Exception as exc:  # a page saying why, never an HTTP 500
            logger.warning("celery-dedup: cannot import the task modules", exc_info=True)
            self.message_user(request, _("Cannot import the Celery app's task modules: "
                                         "%(error)s") % {"error": exc}, messages.ERROR)

    def _rows(self, app: Any, locks: Sequence[Lock]) -> list[LockRow]:
        urls = self._result_urls(lock.task_id for lock in locks)
        return [LockRow(assess(app, lock), urls.get(lock.task_id)) for lock in locks]

    # -- the action --------------------------------------------------------

    @admin.action(  # type: ignore[untyped-decorator]
        description=_("Release selected locks…"), permissions=["delete"]
    )
    def release_selected(
        self, request: HttpRequest, selected: Sequence[tuple[str, str]]
    ) -> HttpResponse | None:
        """Show the selected locks with their holders' state; release them once confirmed.

        A lock still needed is released only with the "release them anyway"
        box ticked; each release is owner-checked against the holder shown.
        """
        store, _prefix, app = self.get_store()
        current = [_still_held(store, key, owner) for key, owner in selected]
        held = [lock for lock in current if lock is not None]
        gone = len(current) - len(held)
        if request.POST.get("post") != "yes":
            rows = self._rows(app, held)
            context = {
                **self.admin_site.each_context(request),
                "opts": self.opts,
                "title": _("Release deduplication locks?"),
                "subtitle": None,
                "rows": rows,
                "needed": [row for row in rows if row.needed],
                "gone": gone,
                "action_checkbox_name": ACTION_CHECKBOX_NAME,
                "action": "release_selected",
            }
            request.current_app = self.admin_site.name
            return TemplateResponse(request, self.release_confirmation_template, context)
        force = request.POST.get("force") == "yes"
        released, kept = 0, []
        for found in (assess(app, lock) for lock in held):
            if found.needed and not force:
                kept.append(found)
                continue
            if release(found.lock.key, owner=found.lock.owner, app=app):
                released += 1
                logger.info(
                    "celery-dedup: %s released lock %s of %s from the admin (%s%s)",
                    request.user, found.lock.key.rsplit(":", 1)[-1][:16], found.holder,
                    found.phase, ", still needed" if found.needed else "",
                )
            else:
                gone += 1
        self._report(request, released, kept, gone)
        return None

    def _report(
        self, request: HttpRequest, released: int, kept: Sequence[Assessment], gone: int
    ) -> None:
        self.message_user(
            request,
            ngettext("Released %(n)d lock.", "Released %(n)d locks.", released) % {"n": released},
            messages.SUCCESS,
        )
        for found in kept:
            self.message_user(
                request,
                _("Kept %(digest)s of %(holder)s: %(why)s.") % {
                    "digest": found.lock.key.rsplit(":", 1)[-1][:16],
                    "holder": found.holder,
                    "why": found.why,
                },
                messages.WARNING,
            )
        if gone:
            self.message_user(
                request,
                ngettext(
                    "%(n)d lock was not released: it expired or has a new holder.",
                    "%(n)d locks were not released: they expired or have a new holder.",
                    gone,
                )
                % {"n": gone},
                messages.WARNING,
            )

    # -- the page ----------------------------------------------------------

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """List live locks (search, task filter, call lookup, pages) and run the action."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        if request.method == "POST":
            return self._run_action(request)
        store, prefix, app = self.get_store()
        self._import_tasks(request, app)
        locks: list[Lock] = []
        if store is not None:
            try:
                locks = sorted(store.scan(prefix), key=lambda lock: (lock.task_name, lock.key))
            except (ScanNotSupported, StoreUnavailable) as exc:
                # A page saying why, never an HTTP 500: memcached cannot list its keys.
                self.message_user(request, _("Cannot list the live locks: %(error)s")
                                  % {"error": exc}, messages.ERROR)
        query = request.GET.get("q", "").strip()
        task = request.GET.get("task", "")
        lookup = _Lookup(app, request.GET)
        shown = [
            lock for lock in locks
            if _matches(lock, query, task) and (lookup.key is None or lock.key == lookup.key)
        ]
        pages = max(1, -(-len(shown) // PER_PAGE))
        page = min(max(_int(request.GET.get("p"), 1), 1), pages)
        actions = self.get_actions(request)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": _("Live deduplication locks"),
            "subtitle": None,
            "store": store,
            "prefix": prefix,
            "rows": self._rows(app, shown[(page - 1) * PER_PAGE : page * PER_PAGE]),
            "total": len(locks),
            "matched": len(shown),
            "filtered": bool(query or task or lookup.key),
            "page": page,
            "pages": pages,
            "page_links": _page_links(request, pages),
            "task_names": sorted({lock.task_name for lock in locks}),
            "task": task,
            "query": query,
            "lookup": lookup,
            "action_choices": [(name, desc) for name, (_f, _n, desc) in actions.items()],
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
            "has_view_permission": True,
            **(extra_context or {}),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.change_list_template, context)

    def limits_view(self, request: HttpRequest) -> HttpResponse:
        """List the live concurrency keys (slots in use) and rate keys (their window).

        Read-only, the same access as the list of locks; ``?task=`` narrows
        it to one task. Keys show as their task and digest: the text of a
        ``concurrency_key``/``rate_key`` is never stored.
        """
        if not self.has_view_permission(request):
            raise PermissionDenied
        store, prefix, app = self.get_store()
        self._import_tasks(request, app)
        task = request.GET.get("task", "")
        listed: dict[str, list[dict[str, Any]]] = {"concurrency": [], "rate": []}
        if store is not None:
            try:
                listed = live_keys(store, prefix.rstrip(":"), app.tasks, task or None)
            except DedupError as exc:
                # A page saying why, never an HTTP 500 (a store that keeps no limits).
                self.message_user(request, _("Cannot list the per-key limits: %(error)s")
                                  % {"error": exc}, messages.ERROR)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": _("Per-key limits"),
            "subtitle": None,
            "store": store,
            "task": task,
            "slots": [_LimitRow(row) for row in listed["concurrency"]],
            "windows": [_LimitRow(row) for row in listed["rate"]],
            "has_view_permission": True,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.limits_template, context)

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
            return HttpResponseRedirect(request.get_full_path())
        response = actions[name][0](self, request, selected)
        if isinstance(response, HttpResponse):
            return response
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


class _LimitRow:
    """One row of ``live_keys`` as the limits page shows it."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.task_name: str = row["task"]
        self.digest: str = row["digest"][:16]
        self.limit = "?" if row["limit"] is None else str(row["limit"])
        self.in_use = row.get("in_use")
        self.count = row.get("count")
        period = row.get("period")
        self.period = "?" if period is None else duration(period)
        free_in = row.get("free_in") or 0.0
        self.free_in = duration(max(free_in, 1.0)) if free_in else ""
        self.last_task_id = row.get("last_task_id", "")


class _Lookup:
    """"Which lock would this call take?": a task name and JSON arguments → its key."""

    def __init__(self, app: Any, params: Any) -> None:
        self.task_names = sorted(
            name for name, task in app.tasks.items() if hasattr(task, "dedup_config")
        )
        self.task = params.get("lookup_task", "")
        self.args = params.get("lookup_args", "").strip()
        self.kwargs = params.get("lookup_kwargs", "").strip()
        self.key: str | None = None
        self.error = ""
        if self.task:
            self._resolve(app)

    @property
    def digest(self) -> str:
        """The first 16 hex digits of the looked-up key."""
        return (self.key or "").rsplit(":", 1)[-1][:16]

    def _resolve(self, app: Any) -> None:
        task = app.tasks.get(self.task)
        if task is None or not hasattr(task, "dedup_config"):
            self.error = str(_("No deduplicated task is called %(task)s.") % {"task": self.task})
            return
        try:
            args = json.loads(self.args or "[]")
            kwargs = json.loads(self.kwargs or "{}")
            if not isinstance(args, list) or not isinstance(kwargs, dict):
                raise ValueError("arguments must be a JSON list, keyword arguments a JSON object")
            key = dedup_key_for(task, args, kwargs)
        except (ValueError, TypeError) as exc:
            self.error = str(exc)
            return
        if key is None:
            self.error = str(_("This call takes no lock."))
            return
        self.key = key


def _still_held(store: LockStore | None, key: str, task_id: str) -> Lock | None:
    """The lock at ``key`` if the holder shown on the page (``task_id``) still holds it."""
    lock = store.get(key) if store is not None else None
    return lock if lock is not None and lock.task_id == task_id else None


def _int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _page_links(request: HttpRequest, pages: int) -> list[tuple[int, str]]:
    params = request.GET.copy()
    links = []
    for number in range(1, pages + 1):
        params["p"] = str(number)
        links.append((number, "?" + params.urlencode()))
    return links


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
