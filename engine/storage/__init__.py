"""What lands on disk: model directories, torch_dist checkpoints, resumable train state,
HF SafeTensors export and import. Re-exports nothing."""
