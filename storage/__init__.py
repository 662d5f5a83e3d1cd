"""The data: SQLAlchemy models, sessions, repositories (every SQL query) and the blob store."""
