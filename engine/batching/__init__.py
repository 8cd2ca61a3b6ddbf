"""Rows into micro-batches: collation, epoch sampling, token budgets and balancing,
packing. Re-exports nothing."""
