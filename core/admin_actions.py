"""Shared helper for admin actions: apply a service to each selected row and report.

A refusal from a service (a locked model, an attached SAE, an unvalidated circuit) is
shown as the message the API would give, and the other rows still proceed; the object's own
delete page shows it the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.http import HttpResponseRedirect
from django.urls import reverse

from core.errors import MillmError


def run_each(modeladmin: admin.ModelAdmin, request, objects: Iterable, verb: str, action: Callable) -> None:
    done = 0
    for obj in objects:
        try:
            action(obj)
            done += 1
        except MillmError as exc:
            modeladmin.message_user(request, f"{obj}: {exc.message} ({exc.code})", level=messages.ERROR)
    if done:
        modeladmin.message_user(request, f"{verb} {done} item(s).", level=messages.SUCCESS)


class RefusableDeleteMixin:
    """For a ModelAdmin whose ``delete_model`` is a service that may refuse (a locked or
    loaded model, an attached SAE): the object's own delete page then shows the refusal
    on the object's page, as the bulk action does, instead of a 500. The refusal escapes
    Django's ``transaction.atomic`` around the view, so its deletion log entry is rolled
    back with it."""

    def delete_view(self, request, object_id, extra_context=None):
        try:
            return super().delete_view(request, object_id, extra_context)
        except MillmError as exc:
            obj = self.get_object(request, unquote(object_id))
            self.message_user(request, f"{obj}: {exc.message} ({exc.code})", level=messages.ERROR)
            opts = self.model._meta
            return HttpResponseRedirect(
                reverse(
                    f"admin:{opts.app_label}_{opts.model_name}_change",
                    args=(quote(obj.pk),),
                    current_app=self.admin_site.name,
                )
            )
