"""Validation: compare an artifact with its reference, gate, report."""
