"""Held-out evaluation: scoring a policy's generations, statistics, the report and plots.
Re-exports nothing."""
