"""Defaults shared by modules that must not import each other (the job spec and the store)."""

DEFAULT_DB = "data/velox.db"  # the store a job writes without output.db or --db
