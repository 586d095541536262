"""Prefect flows: the training pipeline (the chain of stage tasks)."""
