"""The run gate waiter table: the ``keep_last`` follow-up woken when the run it waits for ends.

Until it exists the store works as before: a follow-up waits with its
deferral backoff alone (a warning names the missing table).
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies = [("celery_dedup", "0002_lock_owner_token")]

    operations: list[Any] = [
        migrations.CreateModel(
            name='DedupGateWaiter',
            fields=[
                ('key', models.CharField(max_length=512, primary_key=True, serialize=False, verbose_name='gate key')),
                ('payload', models.TextField(verbose_name='message (base64)')),
                ('expires_at', models.FloatField(verbose_name='expires at (epoch seconds)')),
            ],
            options={
                'verbose_name': 'run gate waiter',
                'verbose_name_plural': 'run gate waiters',
                'db_table': 'celery_dedup_gate_wait',
                'indexes': [models.Index(fields=['expires_at'], name='celery_dedup_gate_wait_exp')],
            },
        ),
    ]
