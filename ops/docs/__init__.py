"""Documentation generated from the code, so it cannot drift from it."""
