# Offpeak on a GPU host: the CUDA build of vLLM (the `gpu` extra). CPU hosts use `.[cpu]` instead.
# The base is pinned to a release so a rebuild gets the same Python and Debian.
FROM python:3.11.7-slim-bookworm
WORKDIR /app
COPY pyproject.toml README.md ./
COPY api api
COPY workers workers
COPY storage storage
COPY migrations migrations
COPY offpeak offpeak
COPY bench bench
COPY examples examples
COPY requirements requirements
# Every release as locked (`make lock`): requirements/gpu.lock, or cpu.lock for the cpu extra,
# whose CPU build of torch needs --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
ARG OFFPEAK_EXTRA=gpu
ARG PIP_EXTRA_INDEX_URL=
RUN pip install --no-cache-dir -c "requirements/${OFFPEAK_EXTRA}.lock" ".[${OFFPEAK_EXTRA}]"
# Not root: a process that escapes Offpeak gets a user with nothing but /data. A new named volume
# mounted at /data takes the folder's owner from the image.
RUN useradd --create-home --uid 10001 offpeak && mkdir -p /data && chown offpeak /data
USER offpeak
ENTRYPOINT ["offpeak"]
