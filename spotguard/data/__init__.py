"""Data-loading helpers whose state survives a change of world size (elastic resume)."""

from .sampler import ElasticDistributedSampler

__all__ = ["ElasticDistributedSampler"]
