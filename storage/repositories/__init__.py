"""Every SQL query, one module per table. Functions take a session and only ``flush()``."""
