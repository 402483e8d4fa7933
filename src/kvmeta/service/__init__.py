"""Operations both dialects share, over any backend."""

from kvmeta.service.core import Operations, Outcome
from kvmeta.service.limits import RequestLimits
from kvmeta.service.ops import Service

__all__ = ["Operations", "Outcome", "RequestLimits", "Service"]
