"""Who is calling: API keys (their format and record, and the store that holds them hashed)."""
