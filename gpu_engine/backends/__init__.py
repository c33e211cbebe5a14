"""Inference backends; implementations import torch lazily."""
