"""Database: an SQLite file in the data directory unless DATABASE_URL names PostgreSQL."""

from .core import CONFIG

DATABASES = {"default": CONFIG.database()}
