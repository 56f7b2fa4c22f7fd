"""nonomad."""
