"""`megazoo launch`: multi-node torchrun rendezvous and Slurm batch scripts for a recipe."""
