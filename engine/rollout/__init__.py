"""Rollout engines: generate token-in/token-out samples and accept new policy weights."""
