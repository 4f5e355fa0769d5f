"""Decoder-side code: the draft client (sync and asyncio), the reference tree decoder, trace
replay (a simulated decoder), baselines and adapters."""
