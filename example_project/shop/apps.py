"""The shop app."""

from django.apps import AppConfig


class ShopConfig(AppConfig):
    """Tasks, two API views and the ``demo`` command."""

    name = "shop"
    default_auto_field = "django.db.models.BigAutoField"
