"""URLs: the admin (with celery-dedup's live locks) and the shop's API."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("", include("shop.urls")),
]
