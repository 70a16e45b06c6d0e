"""The shop's API."""

from django.urls import path

from . import views

urlpatterns = [
    path("payments/", views.create_payment, name="create-payment"),
    path("orders/", views.create_order, name="create-order"),
]
