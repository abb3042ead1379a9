"""Template families in preference order: the first that can implement a (spec, arch) serves it."""

from .sm80 import Sm80Family

REGISTRY = (Sm80Family(),)

__all__ = ["REGISTRY", "Sm80Family"]
