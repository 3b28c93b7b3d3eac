"""Tests of velox_cache/generation/."""
