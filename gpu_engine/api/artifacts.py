"""Stored captures and archives the web serves and reads (``gpu_engine.artifacts``,
``gpu_engine.archives``): file names, capture ids, reading without torch (numpy arrays)."""

from gpu_engine.archives import ArchiveRefused, read_npz
from gpu_engine.artifacts import CaptureData, file_names, is_capture_id, load_capture

__all__ = ["ArchiveRefused", "CaptureData", "file_names", "is_capture_id", "load_capture", "read_npz"]
