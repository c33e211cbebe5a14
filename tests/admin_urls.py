"""The admin's own address of an object: its primary key quoted as the admin quotes it.

A key such as ``sae_22ab…`` holds ``_22``, which the admin reads back as ``"``: a test that
writes the raw key into the address asks for another object whenever the random part starts
with one of the admin's escapes."""

from __future__ import annotations

from django.contrib.admin.utils import quote
from django.urls import reverse


def admin_url(obj, view: str = "change") -> str:
    opts = obj._meta
    return reverse(f"admin:{opts.app_label}_{opts.model_name}_{view}", args=(quote(obj.pk),))
