"""Datasets: opening and validating a SLAF dataset, its cell offsets, and mixtures of
several datasets read as one.
"""
