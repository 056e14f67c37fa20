"""train part of hpctrain (see DESIGN.md)."""
