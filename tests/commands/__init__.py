"""Tests of management commands."""
