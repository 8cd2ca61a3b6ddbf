"""Prefect flows and the ``posttrain`` command line. Orchestration only: no tensors here."""
