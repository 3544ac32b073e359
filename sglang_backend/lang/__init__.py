"""The frontend language (see api.py)."""
