"""The HTTP intake: a thin FastAPI layer over services. Never imports vLLM or torch."""
