"""launch part of hpctrain (see DESIGN.md)."""
