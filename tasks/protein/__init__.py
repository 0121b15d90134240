"""Protein sequence prediction: not yet implemented, see the issues."""
