"""Decoder-side code: trace replay (a simulated decoder) and drafting baselines."""
