"""flaps."""
