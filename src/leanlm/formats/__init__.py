"""Numeric formats: how numbers are represented, knowing nothing of layers or models."""
