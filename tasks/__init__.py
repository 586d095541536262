"""Thin Prefect tasks, one module per pipeline stage, each over one engine function."""
