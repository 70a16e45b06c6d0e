"""The lock and counter tables of the django-db lock store."""

from __future__ import annotations

from typing import Any

from django.db import migrations, models


class Migration(migrations.Migration):  # type: ignore[misc]
    initial = True

    dependencies: list[tuple[str, str]] = []

    operations: list[Any] = [
        migrations.CreateModel(
            name='DedupCounter',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('prefix', models.CharField(max_length=200, verbose_name='key prefix')),
                ('task_name', models.CharField(max_length=255, verbose_name='task name')),
                ('event', models.CharField(max_length=32, verbose_name='event')),
                ('count', models.BigIntegerField(default=0, verbose_name='count')),
            ],
            options={
                'verbose_name': 'deduplication counter',
                'verbose_name_plural': 'deduplication counters',
                'db_table': 'celery_dedup_counter',
                'constraints': [models.UniqueConstraint(fields=('prefix', 'task_name', 'event'), name='celery_dedup_counter_unique')],
            },
        ),
        migrations.CreateModel(
            name='DedupLock',
            fields=[
                ('key', models.CharField(help_text="{prefix}:{task name}:{sha256 of the call's identity}", max_length=512, primary_key=True, serialize=False, verbose_name='key')),
                ('owner', models.CharField(max_length=255, verbose_name='holder task id')),
                ('token', models.CharField(help_text='Random per acquire: tells the acquirer whether it got the lock.', max_length=32, verbose_name='lease token')),
                ('task_name', models.CharField(max_length=255, verbose_name='task name')),
                ('policy', models.CharField(max_length=16, verbose_name='unique until')),
                ('acquired_at', models.FloatField(verbose_name='acquired at (epoch seconds)')),
                ('expires_at', models.FloatField(verbose_name='expires at (epoch seconds)')),
            ],
            options={
                'verbose_name': 'deduplication lock',
                'verbose_name_plural': 'deduplication locks',
                'db_table': 'celery_dedup_lock',
                'ordering': ('key',),
                'indexes': [models.Index(fields=['expires_at'], name='celery_dedup_lock_expires'), models.Index(fields=['task_name'], name='celery_dedup_lock_task')],
            },
        ),
    ]
