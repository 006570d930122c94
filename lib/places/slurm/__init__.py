"""The slurm place (placeholder)."""
