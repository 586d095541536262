"""Work-pool base job templates, the worker image and ``trainyard infra apply`` (``infra.apply``)."""
