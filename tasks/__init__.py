"""Prefect tasks of the `extract` flow and the plain functions they wrap (never imports torch)."""
