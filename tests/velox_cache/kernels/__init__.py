"""Tests of velox_cache/kernels/."""
