"""checkpoint part of hpctrain (see DESIGN.md)."""
