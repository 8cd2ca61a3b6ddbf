"""Stand-alone measurements, run as modules (``python -m benchmarks.<name>``); not tests."""
