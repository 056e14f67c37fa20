"""convert part of hpctrain (see DESIGN.md)."""
