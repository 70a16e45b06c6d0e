"""What the worker did: one row per task body that ran."""

from django.db import models


class TaskRun(models.Model):
    """A task body ran (written by the task itself, in the worker)."""

    task_name = models.CharField(max_length=200)
    task_id = models.CharField(max_length=255)
    detail = models.CharField(max_length=500, blank=True)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ("created",)

    def __str__(self) -> str:
        return f"{self.task_name}[{self.task_id}]"
