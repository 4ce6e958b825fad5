"""E2B compatibility (issue 20)."""
