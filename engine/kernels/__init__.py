"""Paged-attention kernels: Triton implementations, torch references, and the backend choice."""

from engine.kernels.backend import AttentionBackend, BackendName, select_backend

__all__ = ["AttentionBackend", "BackendName", "select_backend"]
