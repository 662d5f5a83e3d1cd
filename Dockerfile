# Offpeak on a GPU host: the CUDA build of vLLM (the `gpu` extra). CPU hosts use `.[cpu]` instead.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY api api
COPY workers workers
COPY storage storage
COPY migrations migrations
COPY offpeak offpeak
COPY bench bench
COPY examples examples
ARG OFFPEAK_EXTRA=gpu
RUN pip install --no-cache-dir ".[${OFFPEAK_EXTRA}]"
ENTRYPOINT ["offpeak"]
