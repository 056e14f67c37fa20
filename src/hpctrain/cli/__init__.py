"""`hpctrain <verb>`: thin argument parsing that calls the parts."""
