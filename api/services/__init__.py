"""The intake's logic: files, batches and keys. Services only flush; callers commit."""
