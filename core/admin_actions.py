"""Shared helper for admin actions: apply a service to each selected row and report.

A refusal from a service (a locked model, an attached SAE, an unvalidated circuit) is
shown as the message the API would give, and the other rows still proceed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from django.contrib import admin, messages

from core.errors import MillmError


def run_each(modeladmin: admin.ModelAdmin, request, objects: Iterable, verb: str,
             action: Callable) -> None:
    done = 0
    for obj in objects:
        try:
            action(obj)
            done += 1
        except MillmError as exc:
            modeladmin.message_user(request, f"{obj}: {exc.message} ({exc.code})",
                                    level=messages.ERROR)
    if done:
        modeladmin.message_user(request, f"{verb} {done} item(s).", level=messages.SUCCESS)
