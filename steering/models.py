"""Steering documents. Today: ``Profile``, a saved set of feature strengths on one SAE
attachment that a /v1 request can name (``profile`` or ``"<model>@<profile>"``).

Rows hold metadata only; resolving a request's steering happens in ``steering.services``.
"""

from __future__ import annotations

from django.db import models


class Profile(models.Model):
    name = models.CharField(max_length=200, unique=True,
                            help_text="What /v1 requests name as `profile` (or `model@name`).")
    description = models.TextField(blank=True)
    model_name = models.CharField(max_length=200, blank=True,
                                  help_text="The model the profile was made for; empty for any.")
    sae_id = models.CharField(max_length=40,
                              help_text="The SAE whose decoder rows the strengths scale.")
    layer = models.PositiveIntegerField(help_text="The decoder block the SAE is attached at.")
    steering = models.JSONField(default=dict, blank=True,
                                help_text='Feature strengths: {"<index>": strength}.')
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
