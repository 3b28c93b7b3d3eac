"""Tests of velox_cache/cache/."""
