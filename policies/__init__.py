"""Sharding policies, one module per mode, found through :data:`POLICIES`."""

from .base import Choice, Policy
from .one_d import OneD
from .tesseract import Tesseract, TwoD
from .three_d import ThreeD

POLICIES: dict[str, type[Policy]] = {"1d": OneD, "2d": TwoD, "2.5d": Tesseract, "3d": ThreeD}

__all__ = ["POLICIES", "Choice", "Policy"]
