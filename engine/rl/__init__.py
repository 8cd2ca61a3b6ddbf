"""The RL stage on Ray: the loop, its phases, the backend-neutral workers, placement,
resume and the off-policy prefetch queue. Re-exports nothing (see tasks/fingerprint.py)."""
