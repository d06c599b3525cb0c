"""Small argparse value parsers shared by the scripts."""

from __future__ import annotations

import argparse


def parse_int_list(text: str) -> tuple[int, ...]:
    """'1,4,8' -> (1, 4, 8); an argparse `type=`."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
