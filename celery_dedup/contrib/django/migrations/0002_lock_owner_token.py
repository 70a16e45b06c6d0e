"""0.2.0: the owner is a random token per publish; the task id and start flag get columns.

Rows written by 0.1.0 keep their task id in ``owner``: ``task_id`` stays
empty (the store then reports the owner as the task id) and ``started``
False. On MySQL/MariaDB the key becomes case-sensitive (``utf8mb4_bin``),
as every other database compares it.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models


def binary_key_on_mysql(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "mysql":
        return
    quote = schema_editor.quote_name
    schema_editor.execute(
        f"ALTER TABLE {quote('celery_dedup_lock')} MODIFY {quote('key')} "
        "VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL"
    )


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies = [("celery_dedup", "0001_initial")]

    operations: list[Any] = [
        migrations.AlterField(
            model_name='deduplock',
            name='owner',
            field=models.CharField(help_text='Random per publish: only the holder\'s message knows it.', max_length=255, verbose_name='owner token'),
        ),
        migrations.AddField(
            model_name='deduplock',
            name='task_id',
            field=models.CharField(blank=True, default='', help_text='Empty on rows written by 0.1.0, whose owner was the task id.', max_length=255, verbose_name='holder task id'),
        ),
        migrations.AddField(
            model_name='deduplock',
            name='started',
            field=models.BooleanField(default=False, help_text="The holder's message passed its start check.", verbose_name='started'),
        ),
        migrations.RunPython(
            binary_key_on_mysql, migrations.RunPython.noop, atomic=False, elidable=True
        ),
    ]
