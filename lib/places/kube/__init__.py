"""The kube place (placeholder)."""
