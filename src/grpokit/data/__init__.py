"""Datasets, prompt templates and the built-in synthetic task."""
