"""Typed errors of the vision path (each names the image or tensor at fault)."""
from k3.errors import K3Error

__all__ = ["K3ImageError"]


class K3ImageError(K3Error, ValueError):
    """An image (or pixel_values / grid_thw pair) that cannot be used: corrupt, empty, too large, unsupported mode,
    or patches that do not match their grid."""
