"""Tests of velox_cache/budgets/."""
