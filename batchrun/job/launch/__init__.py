"""Launching workers: several on one node, Slurm arrays."""
