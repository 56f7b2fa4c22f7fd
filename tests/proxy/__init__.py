"""Tests of the edge proxy."""
