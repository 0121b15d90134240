"""Speech recognition with CTC: not yet implemented, see the issues."""
