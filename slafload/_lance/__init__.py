"""Private: reading Lance data files without Lance's decoder (footers, flat and mini-block
pages, open data files), and every private pylance and Polars API slafload calls
(:mod:`~slafload._lance._compat`).
"""
