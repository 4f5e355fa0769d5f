"""The committed generated wire code matches proto/ (regenerate with python proto/generate.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_current() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--check"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def test_tree_round_trips_packed() -> None:
    from draftcache.v1 import draftcache_pb2 as pb

    tree = pb.Tree(tokens=[5, 6], parents=[-1, 0], sources=bytes([1, 3]), scores=[0.5, 0.25])
    # Packed int32s and raw bytes survive the wire unchanged.
    again = pb.Tree.FromString(tree.SerializeToString())
    assert list(again.tokens) == [5, 6] and list(again.parents) == [-1, 0] and again.sources == b"\x01\x03"
