"""Prefect blocks: configuration and credentials only, never logic.

Trainyard reuses prefect-aws's ``AwsCredentials`` and ``S3Bucket`` for S3; it adds a block only for
what no library block covers.
"""
