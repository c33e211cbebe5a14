"""The /api routes of feature dashboards and search (features/urls.py)."""
