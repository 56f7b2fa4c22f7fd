"""flyd."""
