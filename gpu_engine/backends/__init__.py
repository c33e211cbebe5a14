"""Inference backends. ``base`` defines the protocol; implementations import torch lazily."""
