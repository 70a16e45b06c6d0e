"""``manage.py dedup_locks``: the ``celery dedup`` CLI as a Django management command.

::

    manage.py dedup_locks list [--task NAME] [--json]
    manage.py dedup_locks show KEY_OR_DIGEST_OR_TASK_ID [--json]
    manage.py dedup_locks release KEY_OR_DIGEST [--force] [--dry-run]
    manage.py dedup_locks purge [--task NAME] [--force [--noinput]] [--dry-run]
    manage.py dedup_locks reap [--task NAME] [--dry-run]
    manage.py dedup_locks stats [--json]
    manage.py dedup_locks check [--json] [--timeout SECONDS]

The same subcommands, options and rules as ``celery -A proj dedup`` (both
run ``celery_dedup.cli.Operator``), on the store of the project's Celery app
(``current_app``). No subcommand releases a lock its policy still needs
without ``--force``; every release is owner-checked.
"""

from __future__ import annotations

from typing import Any, cast

from django.core.management.base import BaseCommand, CommandError, CommandParser

from celery_dedup.cli import CommandFailed, Operator, check_lines, check_report
from celery_dedup.startup import PROBE_TIMEOUT

_HELP = {
    "list": "List the live locks.",
    "show": "Show one lock (by key, digest prefix or holder task id) and whether it is needed.",
    "release": "Release one lock; a lock its policy still needs only with --force.",
    "purge": "Release the locks no longer needed; --force releases the others too.",
    "reap": "Release the locks of holders that finished in a state their policy releases on.",
    "stats": "Per-task counters and live locks.",
    "check": "Probe the store (one acquire/release round trip) and show what each task "
             "would use; exits 1 when deduplication does not work as configured.",
}


def _ask(question: str) -> bool:
    return input(f"{question}\nType 'yes' to continue, or 'no' to cancel: ").strip() == "yes"


class Command(BaseCommand):  # type: ignore[misc]
    """Inspect and manage celery-dedup locks."""

    help = "List, show, release, purge or reap the celery-dedup locks of the project's Celery app."

    def add_arguments(self, parser: CommandParser) -> None:
        """Subcommands ``list``, ``show``, ``release``, ``purge``, ``reap``, ``stats``."""
        sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        parsers = {name: sub.add_parser(name, help=text, description=text)
                   for name, text in _HELP.items()}
        for name in ("list", "purge", "reap"):
            parsers[name].add_argument("--task", metavar="NAME",
                                       help="Only the locks of this task name.")
        for name in ("list", "show", "stats", "check"):
            parsers[name].add_argument("--json", action="store_true", dest="as_json",
                                       help="Print JSON.")
        for name in ("release", "purge", "reap"):
            parsers[name].add_argument("--dry-run", action="store_true",
                                       help="Only print what would be released.")
        parsers["check"].add_argument(
            "--timeout", type=float, default=PROBE_TIMEOUT,
            help="Seconds to wait for the store before calling it unreachable.",
        )
        parsers["show"].add_argument(
            "key_or_task_id", metavar="KEY_OR_TASK_ID",
            help="A key, a digest prefix, or the holder's task id (or a prefix of it).",
        )
        parsers["release"].add_argument(
            "key", metavar="KEY", help="A key or a unique prefix of its digest."
        )
        parsers["release"].add_argument("-f", "--force", action="store_true",
                                        help="Release even a lock its policy still needs.")
        parsers["purge"].add_argument("-f", "--force", action="store_true",
                                      help="Also release locks still needed (asks first).")
        parsers["purge"].add_argument("--noinput", "--no-input", "-y", "--yes",
                                      action="store_true", dest="yes",
                                      help="Don't ask before --force releases needed locks.")
        parsers["purge"].add_argument("--expired", action="store_true",
                                      help="Deprecated, no effect: purge releases only the "
                                      "locks no longer needed unless --force.")

    def handle(self, *args: Any, **options: Any) -> None:
        """Run the subcommand through ``celery_dedup.cli.Operator``."""
        from celery import current_app

        action = options["action"]
        if options.get("expired"):
            self.stderr.write("--expired is deprecated and has no effect: purge now releases "
                              "only the locks no longer needed, unless --force.")
        if action == "check":
            self._check(cast(Any, current_app)._get_current_object(), options)
            return
        try:
            operator = Operator(
                cast(Any, current_app)._get_current_object(),
                self.stdout.write,
                _ask,
                ok=self.style.SUCCESS("OK"),
            )
            if action == "list":
                operator.list(options["task"], options["as_json"])
            elif action == "show":
                operator.show(options["key_or_task_id"], options["as_json"])
            elif action == "release":
                operator.release(options["key"], force=options["force"],
                                 dry_run=options["dry_run"])
            elif action == "purge":
                operator.purge(options["task"], force=options["force"], yes=options["yes"],
                               dry_run=options["dry_run"])
            elif action == "reap":
                operator.reap(options["task"], dry_run=options["dry_run"])
            else:
                operator.stats(options["as_json"])
        except CommandFailed as exc:
            raise CommandError(str(exc)) from exc

    def _check(self, app: Any, options: dict[str, Any]) -> None:
        from kombu.utils.json import dumps

        app.loader.import_default_modules()
        ok, report = check_report(app, options["timeout"])
        if options["as_json"]:
            self.stdout.write(dumps({"ok": ok, **report}))
        else:
            for line in check_lines(ok, report, self.style.SUCCESS("OK")):
                self.stdout.write(line)
        if not ok:
            raise CommandError("deduplication does not work as configured", returncode=1)
