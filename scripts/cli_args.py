"""Small argparse value parsers shared by the scripts."""

from __future__ import annotations

import argparse


def parse_int_list(text: str) -> tuple[int, ...]:
    """'1,4,8' -> (1, 4, 8); an argparse `type=`."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parse_positive_int_list(text: str) -> tuple[int, ...]:
    """Like parse_int_list, but at least one value and every value >= 1 (sizes, counts)."""
    values = parse_int_list(text)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values
