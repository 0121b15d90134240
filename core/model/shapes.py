"""Padded shapes: the widths that rows of varying length are padded to, so that training,
evaluation and generation compile a few programs and reuse them (each width is one program)."""

from __future__ import annotations


def bucket_width(length: int, cap: int) -> int:
    """The padded width for `length` positions, at most `cap`: a multiple of 8 up to 32, then
    the next of 48, 64, 96, 128, 192, ... (a third of padding at most): each width is a compiled
    program, so there are few of them."""
    length = int(length)
    width = 8 * -(-length // 8)
    if width > 32:
        width = 1 << (length - 1).bit_length()  # the next power of two
        if 3 * width // 4 >= length:
            width = 3 * width // 4
    return max(1, min(width, cap))
