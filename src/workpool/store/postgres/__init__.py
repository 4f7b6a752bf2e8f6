"""The PostgreSQL store (scale-out)."""
