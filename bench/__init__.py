"""Offpeak's benchmarks (``offpeak bench e2e|intake|control|memory``): each measures a ratio side
by side in one run, prints a table and writes JSON under ``bench/results/``.

Like ``tests/``, this folder belongs to the checkout, not to the installed package.
"""
