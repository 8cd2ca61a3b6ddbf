"""Backend-neutral losses and training loops (optimizer step, actor, critic, reward model,
SFT) and the backend contracts. Re-exports nothing."""
