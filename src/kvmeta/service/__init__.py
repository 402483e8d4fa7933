"""Operations both dialects share, over any backend."""

from kvmeta.service.limits import RequestLimits
from kvmeta.service.ops import Service
from kvmeta.service.warnings import Outcome

__all__ = ["Outcome", "RequestLimits", "Service"]
